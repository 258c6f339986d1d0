# bench_one_batch on the Llama-3-8B-shaped dummy model (bf16, random weights), 128 in / 512 and 256 out, beside HF
# transformers generate (static cache, eager) on the same batches. carry: .whl
#   bash benchmarks/gpu/bench_decode_batch_sweep.sh [BATCH_SIZE...]   (default 1 8 32 64 128 256; ~6 min)
set -o pipefail
source benchmarks/gpu/setup.sh
BATCH_SIZES=${*:-1 8 32 64 128 256}
nvidia-smi -L
# shellcheck disable=SC2086
timeout 540 python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
  --model-path llama3-8b-dummy --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 256 --log-level warning \
  --batch-size $BATCH_SIZES --input-len 128 --output-len 512 256 --compare-hf --hf-output-len 32 \
  --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -v Warning | tee "$OUT/one_batch.log"
