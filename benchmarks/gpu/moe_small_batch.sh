# The decode-batch MoE path (runtime/layers/moe: one-launch router, small-batch GEMV experts with the shared experts
# stacked in) at DeepSeek-V2-Lite shapes on one GPU: the MoE gpu tests (fused == torch at real shapes, the whole
# layer with shared experts, three layers replayed in one CUDA graph) and the MLA decode kernels' tests compiled
# (tests/kernels/test_mla_kernels.py: latent store + w_kc query build, the w_vc GEMV), then benchmarks/gpu/moe_small_batch.py
# (router, experts at T = 1..16 vs the grouped GEMM with a config sweep, the layer; see its docstring). ~4 min.
# carry: .whl
#   bash benchmarks/gpu/moe_small_batch.sh
set -o pipefail
source benchmarks/gpu/setup.sh
OUT=${OUT:-/tmp/moe_small_batch_out}; mkdir -p "$OUT"
nvidia-smi -L
timeout 200 python3 -m pytest tests/kernels/test_fused_moe.py tests/kernels/test_mla_kernels.py -q -p no:cacheprovider \
  -k "gpu or small_batch or one_launch or triton_router or mla_kernels" 2>&1 | tail -12 | tee "$OUT/moe_gpu_tests.log"
if grep -qE "[0-9]+ passed" "$OUT/moe_gpu_tests.log" && ! grep -qE "failed|error" "$OUT/moe_gpu_tests.log"; then
  echo "PASS MoE and MLA-kernel gpu tests"
else
  echo "FAIL MoE or MLA-kernel gpu tests (see above)"
fi
timeout 300 python3 benchmarks/gpu/moe_small_batch.py 2>&1 | grep -v Warning | tee "$OUT/moe_small_batch.log" \
  || echo "FAIL moe_small_batch.py (exit $?; 124 = timeout)"
