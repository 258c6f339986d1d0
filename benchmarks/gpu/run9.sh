# Device call 2 of session 4 (carry .whl .gpu/fi2, right after run8.sh): flashinfer 0.7.2 from its two halves,
# its backend's kernel tests (JIT-compiled for sm_90), then bench_one_batch with it beside Triton.
set -o pipefail
W=/tmp/flashinfer_python-0.7.2-py3-none-any.whl
cat /tmp/fi_part_aa .gpu/fi2/fi_part_ab > $W && echo "$(cat .gpu/fi2/fi.sha256)  $W" | sha256sum -c || exit 1
source benchmarks/gpu/setup.sh
[ -f /tmp/gemv_env ] && source /tmp/gemv_env
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W .gpu/fi2/apache_tvm_ffi-*.whl 2>&1 | tail -2
export FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
which nvcc; ls /usr/local/cuda/bin/nvcc 2>&1; python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -3
timeout 360 python3 -m pytest tests/kernels/test_flashinfer_backend.py -q -x -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/flashinfer_tests.log
CFG=benchmarks/configs/llama3-8b.json
for B in flashinfer triton; do
timeout 90 python3 -m braid.bench_one_batch --load-format dummy --model-config $CFG --model-path llama3-8b-dummy \
  --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 64 --log-level warning --attention-backend $B \
  --batch-size 1 64 --input-len 1024 --output-len 128 --result-filename $OUT/one_batch_$B.jsonl 2>&1 | grep -v Warning | tail -6 | tee $OUT/one_batch_$B.log
done
