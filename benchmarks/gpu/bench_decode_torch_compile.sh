# bench_one_batch decode with torch.compile + CUDA graphs against the eager-graph path (the peer), both in this call,
# at batch 1, 8 and 32 (dummy weights, bf16, 128 in / 256 out), at the runtime's defaults otherwise (the batch-1
# GEMV, PDL). Only the three measured batch sizes are captured (--cuda-graph-bs), so only three are compiled.
# carry: .whl (or wheels an earlier call left in /tmp/site)
#   bash benchmarks/gpu/bench_decode_torch_compile.sh [config names under benchmarks/configs; default llama3-8b]
set -o pipefail
source benchmarks/gpu/setup.sh
for MODEL in "${@:-llama3-8b}"; do
  for MODE in eager compile; do
    FLAGS=""
    [ $MODE = compile ] && FLAGS="--enable-torch-compile --torch-compile-max-bs 32"
    echo "== $MODEL $MODE" | tee -a "$OUT/decode_torch_compile.log"
    # shellcheck disable=SC2086
    timeout "${COMPILE_RUN_TIMEOUT_S:-280}" python3 -m braid.bench_one_batch --load-format dummy \
      --model-config "benchmarks/configs/$MODEL.json" --model-path "$MODEL-dummy" --dtype bfloat16 \
      --max-total-tokens 20000 --cuda-graph-bs 1 8 32 --log-level warning $FLAGS --batch-size 1 8 32 \
      --input-len 128 --output-len 256 --result-filename "$OUT/decode_${MODEL}_$MODE.jsonl" 2>&1 \
      | grep -v "Warning\|DEBUG" | tail -8 | tee -a "$OUT/decode_torch_compile.log"
  done
done
python3 - "$OUT" "${@:-llama3-8b}" <<'PY'
import json
import sys
from pathlib import Path

out, models = Path(sys.argv[1]), sys.argv[2:]
print("| model | batch | eager tok/s | compile tok/s | compile / eager |\n|---|---|---|---|---|")
for model in models:
    runs = {}
    for mode in ("eager", "compile"):
        path = out / f"decode_{model}_{mode}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            runs[mode, row["batch_size"]] = row["batch_size"] / row["median_decode_latency_s"]
    for bs in (1, 8, 32):
        e, c = runs.get(("eager", bs)), runs.get(("compile", bs))
        ratio = f"{c / e:.3f}x" if e and c else "-"
        print(f"| {model} | {bs} | {e or 0:.1f} | {c or 0:.1f} | {ratio} |")
PY
