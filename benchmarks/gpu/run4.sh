# Device call 1 of session 3 (carry .whl .gpu/a .gpu/tok .gpu/src): GPU kernel tests, then the batch-1 decode study.
cd .gpu/src 2>/dev/null && ln -sfn ../../.whl .whl && mkdir -p .gpu && for d in a b tok; do ln -sfn ../../$d .gpu/$d; done
set -o pipefail
cp ../a/part_aa /tmp/ 2>/dev/null || cp .gpu/a/part_aa /tmp/
source benchmarks/gpu/setup.sh
timeout 150 python3 -m pytest tests/kernels/test_gemv.py "tests/kernels/test_fused_kernels.py::test_rotary_and_store_kv_matches_rotary_then_store" -q -p no:cacheprovider 2>&1 | tail -8 | tee $OUT/kernels.log
timeout 380 python3 benchmarks/gpu/decode_b1.py 2>&1 | grep -v Warning | tee $OUT/decode_b1.log
