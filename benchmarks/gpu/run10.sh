# Device call 3 of session 4 (carry .whl .gpu/a; run2.sh follows on the warm machine): bench_one_batch beside HF
# over batch 1 to 256 with the default decode path (Triton GEMV + PDL at batch 1); keeps the first GGUF part in
# /tmp for run2.sh's SmolLM2 engine checks.
set -o pipefail
cp .gpu/a/part_aa /tmp/part_aa
source benchmarks/gpu/setup.sh
timeout 420 python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
  --model-path llama3-8b-dummy --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 256 --log-level warning \
  --batch-size 1 8 32 64 128 256 --input-len 128 --output-len 512 256 --compare-hf --hf-output-len 32 \
  --result-filename $OUT/one_batch.jsonl 2>&1 | grep -v Warning | tee $OUT/one_batch.log
