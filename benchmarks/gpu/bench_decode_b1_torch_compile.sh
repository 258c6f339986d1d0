# bench_one_batch at batch 1 (Llama-3-8B-shaped dummy, bf16, 128 in / 256 out) with torch.compile + CUDA graphs,
# to set beside the eager-graph figure of bench_decode_batch_sweep.sh. carry: .whl
#   bash benchmarks/gpu/bench_decode_b1_torch_compile.sh
set -o pipefail
source benchmarks/gpu/setup.sh
timeout 300 python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
  --model-path llama3-8b-dummy --dtype bfloat16 --max-total-tokens 20000 --cuda-graph-max-bs 4 --log-level warning \
  --enable-torch-compile --torch-compile-max-bs 1 --batch-size 1 --input-len 128 --output-len 256 \
  --result-filename "$OUT/one_batch_compile.jsonl" 2>&1 | grep -v "Warning\|DEBUG" | tail -30 | tee "$OUT/one_batch_compile.log"
