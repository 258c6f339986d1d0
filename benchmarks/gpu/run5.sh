# Device call 2 of session 3 (carry .whl .gpu/b .gpu/tok .gpu/src, right after run4.sh): SmolLM2 engine checks on the GPU
# (fp32 Triton + graphs == torch with rotary fused into the KV write; bf16 with the batch-1 Triton GEMV).
cd .gpu/src 2>/dev/null && ln -sfn ../../.whl .whl && mkdir -p .gpu && for d in a b tok; do ln -sfn ../../$d .gpu/$d; done
set -o pipefail
source benchmarks/gpu/setup.sh
[ -f /tmp/gemv_env ] && source /tmp/gemv_env && echo "BRAID_GEMV_FUSE_NORM=$BRAID_GEMV_FUSE_NORM"
cat /tmp/part_aa .gpu/b/part_ab > /tmp/smollm2.gguf && echo "$(cat .gpu/tok/smollm2.sha256)  /tmp/smollm2.gguf" | sha256sum -c
export BRAID_SMOLLM2_GGUF=/tmp/smollm2.gguf
timeout 200 python3 -m pytest tests/models/test_gpu_engine.py -q -s -p no:cacheprovider 2>&1 | grep -v Warning | tail -25 | tee $OUT/gpu_engine.log
