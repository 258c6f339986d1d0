# bench_one_batch at batch 1 (Llama-3-8B-shaped dummy, bf16, 128 in / 256 out): torch.compile + CUDA graphs against
# the eager-graph path (the peer), both in this call, at the runtime's defaults otherwise (the batch-1 GEMV on).
# carry: .whl
#   bash benchmarks/gpu/bench_decode_b1_torch_compile.sh
set -o pipefail
source benchmarks/gpu/setup.sh
for MODE in eager compile; do
  FLAGS=""
  [ $MODE = compile ] && FLAGS="--enable-torch-compile --torch-compile-max-bs 1"
  echo "== $MODE" | tee -a "$OUT/one_batch_compile.log"
  # shellcheck disable=SC2086
  timeout 300 python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
    --model-path llama3-8b-dummy --dtype bfloat16 --max-total-tokens 20000 --cuda-graph-max-bs 4 --log-level warning \
    $FLAGS --batch-size 1 --input-len 128 --output-len 256 --result-filename "$OUT/one_batch_$MODE.jsonl" 2>&1 \
    | grep -v "Warning\|DEBUG" | tail -12 | tee -a "$OUT/one_batch_compile.log"
done
