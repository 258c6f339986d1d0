# Device call 2 of session 3 (carry .whl .gpu/b .gpu/tok .gpu/src, right after run4.sh): SmolLM2 engine checks on the GPU
# (fp32 Triton + graphs == torch with rotary fused into the KV write; bf16 with the fused batch-1 GEMV), then
# bench_one_batch at batch 1 beside HF and the batch sweep.
cd .gpu/src 2>/dev/null && ln -sfn ../../.whl .whl && mkdir -p .gpu && for d in a b tok; do ln -sfn ../../$d .gpu/$d; done
set -o pipefail
source benchmarks/gpu/setup.sh
[ -f /tmp/gemv_env ] && source /tmp/gemv_env && echo "BRAID_GEMV_FUSE_NORM=$BRAID_GEMV_FUSE_NORM"
cat /tmp/part_aa .gpu/b/part_ab > /tmp/smollm2.gguf && echo "$(cat .gpu/tok/smollm2.sha256)  /tmp/smollm2.gguf" | sha256sum -c
export BRAID_SMOLLM2_GGUF=/tmp/smollm2.gguf
timeout 200 python3 -m pytest tests/models/test_gpu_engine.py -q -s -p no:cacheprovider 2>&1 | grep -v Warning | tail -25 | tee $OUT/gpu_engine.log
CFG=benchmarks/configs/llama3-8b.json
timeout 330 python3 -m braid.bench_one_batch --load-format dummy --model-config $CFG --model-path llama3-8b-dummy \
  --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 256 --log-level warning \
  --batch-size 1 8 32 64 128 256 --input-len 128 --output-len 512 256 --compare-hf --hf-output-len 32 \
  --result-filename $OUT/one_batch.jsonl 2>&1 | grep -v Warning | tee $OUT/one_batch.log
