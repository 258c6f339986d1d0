# Where the batch-1 decode step of the Llama-3-8B-shaped model goes: benchmarks/gpu/decode_b1.py (weight GEMMs
# alone in one CUDA graph, cuBLAS vs the Triton GEMV, then the whole step under each decode-path choice), after the
# GPU kernel tests that guard those kernels. carry: .whl
#   bash benchmarks/gpu/bench_decode_b1_breakdown.sh [decode_b1.py flags, e.g. --sweep]
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
timeout 200 python3 -m pytest tests/kernels -q -m gpu -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/kernels.log"
timeout 380 python3 benchmarks/gpu/decode_b1.py "$@" 2>&1 | grep -v Warning | tee "$OUT/decode_b1.log"
