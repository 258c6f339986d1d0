# Device call 4 of session 3 (carry .whl .gpu/fi2 .gpu/src, right after run6.sh): flashinfer 0.7.2 from its two
# halves, its backend's kernel tests (JIT-compiled for sm_90), then bench_one_batch with it beside Triton.
cd .gpu/src 2>/dev/null && ln -sfn ../../.whl .whl && mkdir -p .gpu && for d in fi1 fi2; do ln -sfn ../../$d .gpu/$d; done
set -o pipefail
W=/tmp/flashinfer_python-0.7.2-py3-none-any.whl
cat /tmp/fi_part_aa .gpu/fi2/fi_part_ab > $W && echo "$(cat .gpu/fi2/fi.sha256)  $W" | sha256sum -c
source benchmarks/gpu/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W .gpu/fi2/apache_tvm_ffi-*.whl 2>&1 | tail -2
export FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -3
timeout 330 python3 -m pytest tests/kernels/test_flashinfer_backend.py -q -x -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/flashinfer_tests.log
CFG=benchmarks/configs/llama3-8b.json
for B in flashinfer triton; do
timeout 100 python3 -m braid.bench_one_batch --load-format dummy --model-config $CFG --model-path llama3-8b-dummy \
  --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 64 --log-level warning --attention-backend $B \
  --batch-size 1 64 --input-len 1024 --output-len 128 --result-filename $OUT/one_batch_$B.jsonl 2>&1 | grep -v Warning | tail -6 | tee $OUT/one_batch_$B.log
done
