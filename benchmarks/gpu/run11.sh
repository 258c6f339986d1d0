# Device calls 5-6 of session 4. `run11.sh a` (carry .whl .gpu/a): keep the first GGUF part in /tmp and time
# bench_one_batch at batch 1 with torch.compile + graphs; `run11.sh b` (carry .whl .gpu/b .gpu/tok, right after):
# the SmolLM2 engine checks (Triton + graphs + PDL == torch; torch.compile + graphs == torch).
set -o pipefail
source benchmarks/gpu/setup.sh
if [ "$1" = a ]; then
  cp .gpu/a/part_aa /tmp/part_aa
  timeout 300 python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
    --model-path llama3-8b-dummy --dtype bfloat16 --max-total-tokens 20000 --cuda-graph-max-bs 4 --log-level warning \
    --enable-torch-compile --torch-compile-max-bs 1 --batch-size 1 --input-len 128 --output-len 256 \
    --result-filename $OUT/one_batch_compile.jsonl 2>&1 | grep -v "Warning\|DEBUG" | tail -30 | tee $OUT/one_batch_compile.log
else
  cat /tmp/part_aa .gpu/b/part_ab > /tmp/smollm2.gguf && echo "$(cat .gpu/tok/smollm2.sha256)  /tmp/smollm2.gguf" | sha256sum -c || exit 1
  export BRAID_SMOLLM2_GGUF=/tmp/smollm2.gguf
  timeout 300 python3 -m pytest tests/models/test_gpu_engine.py -q -s -p no:cacheprovider 2>&1 | grep -v "Warning\|DEBUG" | tail -60 | tee $OUT/gpu_engine.log
fi
