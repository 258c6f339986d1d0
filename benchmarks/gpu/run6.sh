# Device call 3 of session 3 (carry .whl .gpu/fi1 .gpu/src, right after run5.sh): bench_one_batch beside HF, batch 1
# to 256; keeps the first half of the flashinfer wheel in /tmp for run7.sh.
cd .gpu/src 2>/dev/null && ln -sfn ../../.whl .whl && mkdir -p .gpu && for d in fi1 fi2; do ln -sfn ../../$d .gpu/$d; done
set -o pipefail
cp .gpu/fi1/fi_part_aa /tmp/
source benchmarks/gpu/setup.sh
[ -f /tmp/gemv_env ] && source /tmp/gemv_env && echo "BRAID_GEMV_FUSE_NORM=$BRAID_GEMV_FUSE_NORM"
CFG=benchmarks/configs/llama3-8b.json
timeout 330 python3 -m braid.bench_one_batch --load-format dummy --model-config $CFG --model-path llama3-8b-dummy \
  --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 256 --log-level warning \
  --batch-size 1 8 32 64 128 256 --input-len 128 --output-len 512 256 --compare-hf --hf-output-len 32 \
  --result-filename $OUT/one_batch.jsonl 2>&1 | grep -v Warning | tee $OUT/one_batch.log
