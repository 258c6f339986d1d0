# Per-kernel time of one decode step (benchmarks/gpu/decode_step_kernels.py) for the wave-2 batch-1 targets, each
# beside its CUDA-graph step time: DeepSeek-V2-Lite (batch 1, 128 in), Llama-3-8B with fp8 weights (batch 1, 128 in),
# Gemma-2-9B at 8K (batch 1); llama (bf16, batch 1, 128 in) and llama16 (the same with 16 KV splits fixed, the split
# count before decode_kv_splits) and dsv2fp8 (DeepSeek-V2-Lite with --quantization fp8: e4m3 linears, experts and
# w_kc / w_vc) when named. Pass names to run a subset. carry: .whl
#   bash benchmarks/gpu/decode_step_kernels.sh [dsv2] [fp8] [gemma2] [llama] [llama16] [dsv2fp8]
set -o pipefail
source benchmarks/gpu/setup.sh
[ $# -gt 0 ] || set -- dsv2 fp8 gemma2
K="python3 benchmarks/gpu/decode_step_kernels.py --load-format dummy --dtype bfloat16 --log-level warning --batch-size 1"
for what in "$@"; do
  echo "=== $what"
  case $what in
    dsv2) timeout 200 $K --model-config benchmarks/configs/deepseek-v2-lite.json --model-path dsv2-lite-dummy \
            --input-len 128 --output-len 128 ;;
    dsv2fp8) timeout 200 $K --model-config benchmarks/configs/deepseek-v2-lite.json --model-path dsv2-lite-dummy \
               --quantization fp8 --input-len 128 --output-len 128 ;;
    llama) timeout 160 $K --model-config benchmarks/configs/llama3-8b.json --model-path llama3-8b-dummy \
             --input-len 128 --output-len 256 --top 12 ;;
    llama16) timeout 160 $K --model-config benchmarks/configs/llama3-8b.json --model-path llama3-8b-dummy \
               --input-len 128 --output-len 256 --top 12 --triton-attention-num-kv-splits 16 ;;
    fp8) timeout 160 $K --model-config benchmarks/configs/llama3-8b.json --model-path llama3-8b-dummy \
           --quantization fp8 --input-len 128 --output-len 128 ;;
    gemma2) timeout 200 $K --model-config benchmarks/configs/gemma2-9b.json --model-path gemma2-dummy \
              --input-len 8000 --output-len 128 ;;
  esac 2>&1 | grep -v -E "Warning|USDT" | tee "$OUT/kernels_$what.log"
done
