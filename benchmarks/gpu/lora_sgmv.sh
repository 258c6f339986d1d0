# LoRA SGMV kernels against the torch reference and the base matmul at decode shapes (benchmarks/gpu/lora_sgmv.py:
# Llama-3-8B linears, bf16, rank 16, 8 and 64 adapters), GB/s against the card's copy rate measured in the same run.
# carry: .whl
#   bash benchmarks/gpu/lora_sgmv.sh [lora_sgmv.py flags]
set -o pipefail
source benchmarks/gpu/setup.sh
timeout "${LORA_SGMV_TIMEOUT_S:-240}" python3 benchmarks/gpu/lora_sgmv.py "$@" 2>&1 | grep -v "Warning" \
  | tee "$OUT/lora_sgmv.log" | tail -40
