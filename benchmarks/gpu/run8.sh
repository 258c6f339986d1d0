# Device call 1 of session 4 (carry .whl .gpu/fi1): GPU kernel tests (PDL chain included), the batch-1 decode
# A/B with programmatic dependent launch, then bench_one_batch at batch 1 beside HF with the faster settings.
# Keeps the first half of the flashinfer wheel in /tmp for run9.sh.
set -o pipefail
cp .gpu/fi1/fi_part_aa /tmp/
source benchmarks/gpu/setup.sh
nvidia-smi -L
timeout 200 python3 -m pytest tests/kernels -q -m gpu -p no:cacheprovider 2>&1 | tail -8 | tee $OUT/kernels.log
timeout 240 python3 benchmarks/gpu/decode_b1.py 2>&1 | grep -v Warning | tee $OUT/decode_b1.log
[ -f /tmp/gemv_env ] && source /tmp/gemv_env && echo "BRAID_GEMV_FUSE_NORM=$BRAID_GEMV_FUSE_NORM BRAID_PDL=$BRAID_PDL"
timeout 150 python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
  --model-path llama3-8b-dummy --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 8 --log-level warning \
  --batch-size 1 --input-len 128 --output-len 512 --compare-hf --hf-output-len 64 \
  --result-filename $OUT/one_batch_bs1.jsonl 2>&1 | grep -v Warning | tee $OUT/one_batch_bs1.log
