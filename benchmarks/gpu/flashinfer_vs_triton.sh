# The FlashInfer attention backend beside Triton: its kernel tests (JIT for sm_90), then bench_one_batch with each
# (Llama-3-8B-shaped dummy, bf16, batch 1 and 64, 1024 in / 128 out). The flashinfer wheel is over one call's
# 64 MiB with the others, so it travels in two halves (split -n 2 flashinfer_python-0.7.2-py3-none-any.whl fi_part_a,
# sha256sum of the whole in fi.sha256), over two calls on the same warm machine:
#   bash benchmarks/gpu/flashinfer_vs_triton.sh stage   carry .gpu/fi1 (fi_part_aa): keeps the first half in /tmp
#   bash benchmarks/gpu/flashinfer_vs_triton.sh         carry .whl .gpu/fi2 (fi_part_ab, fi.sha256, apache_tvm_ffi-*.whl)
set -o pipefail
if [ "$1" = stage ]; then cp .gpu/fi1/fi_part_aa /tmp/ && echo "first half kept in /tmp"; exit; fi
W=/tmp/flashinfer_python-0.7.2-py3-none-any.whl
cat /tmp/fi_part_aa .gpu/fi2/fi_part_ab > $W && echo "$(cat .gpu/fi2/fi.sha256)  $W" | sha256sum -c || exit 1
source benchmarks/gpu/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W .gpu/fi2/apache_tvm_ffi-*.whl 2>&1 | tail -2
export FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -3
timeout 360 python3 -m pytest tests/kernels/test_flashinfer_backend.py -q -x -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/flashinfer_tests.log"
for BACKEND in flashinfer triton; do
  timeout 90 python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
    --model-path llama3-8b-dummy --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 64 --log-level warning \
    --attention-backend $BACKEND --batch-size 1 64 --input-len 1024 --output-len 128 \
    --result-filename "$OUT/one_batch_$BACKEND.jsonl" 2>&1 | grep -v Warning | tail -6 | tee "$OUT/one_batch_$BACKEND.log"
done
