# Issue 19's two small-batch levers on the H200, one device call (~8 min): the fp8 GEMM at 2..16 rows of x
# (fp8_small_batch_gemm.py: bf16 cuBLAS, the bf16-dot kernel, the tc variant's tiles, quantize + _scaled_mm) and the
# decode attention by KV dtype at 8,160 keys, batch 8 and 64 (decode_attention_kv_dtype.py), after the fp8 kernels'
# GPU tests. carry: .whl
#   bash benchmarks/gpu/fp8_small_batch_and_kv.sh
set -o pipefail
source benchmarks/gpu/setup.sh
started=$(date +%s)
step() { echo; echo "=== $1 (at $(( $(date +%s) - started )) s)"; }

step "gpu tests: fp8 kernels and GEMV variants"
timeout 120 python3 -m pytest tests/kernels/test_fp8_gemv_variants.py tests/kernels/test_fp8_kernels.py -q -m gpu \
  -p no:cacheprovider 2>&1 | grep -v Warning | tail -12 | tee "$OUT/fp8_tests.log"

step "fp8 GEMM at 2..16 rows, per Llama-3-8B shape"
timeout 170 python3 benchmarks/gpu/fp8_small_batch_gemm.py --budget-s 140 --out "$OUT/small_batch.jsonl" 2>&1 \
  | grep -v Warning > "$OUT/small_batch.log"
grep -v '^{' "$OUT/small_batch.log" | tail -30

step "decode attention by KV dtype, batch 8 and 64, 8,160 keys"
timeout 200 python3 benchmarks/gpu/decode_attention_kv_dtype.py --budget-s 160 --out "$OUT/attention.jsonl" 2>&1 \
  | grep -v Warning > "$OUT/attention.log"
grep -v '^{' "$OUT/attention.log" | tail -20
echo "done in $(( $(date +%s) - started )) s"
