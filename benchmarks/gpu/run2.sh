# Second device call: fused-kernel GPU tests and timings (carry .whl).
set -o pipefail
source benchmarks/gpu/setup.sh
timeout 300 python3 -m pytest tests/kernels/test_fused_kernels.py -q -m gpu -p no:cacheprovider 2>&1 | tail -20 | tee $OUT/fused_tests.log
timeout 150 python3 benchmarks/gpu/bench_fused.py 2>&1 | tee $OUT/fused_bench.log
