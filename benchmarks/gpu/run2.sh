# Device call 2 (carry .whl .gpu/b .gpu/tok, right after a call that copied .gpu/a/part_aa to /tmp on the warm machine): SmolLM2 engine
cd .gpu/src 2>/dev/null && ln -sfn ../../.whl .whl && mkdir -p .gpu && for d in a b tok; do ln -sfn ../../$d .gpu/$d; done
# checks (Triton + CUDA graphs vs torch), then bench_serving on a Llama-3-8B-shaped server beside HF batch generation.
set -o pipefail
source benchmarks/gpu/setup.sh
cat /tmp/part_aa .gpu/b/part_ab > /tmp/smollm2.gguf && echo "$(cat .gpu/tok/smollm2.sha256)  /tmp/smollm2.gguf" | sha256sum -c
export BRAID_SMOLLM2_GGUF=/tmp/smollm2.gguf
timeout 220 python3 -m pytest tests/models/test_gpu_engine.py -q -s -p no:cacheprovider 2>&1 | grep -v "Warning\|DEBUG" | tail -60 | tee $OUT/gpu_engine.log
CFG=benchmarks/configs/llama3-8b.json
DATA="--dataset-name random --num-prompts 1000 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5"
python3 -m braid.launch_server --model-path llama3-8b-dummy --load-format dummy --model-config $CFG --tokenizer-path .gpu/tok \
  --dtype bfloat16 --cuda-graph-max-bs 256 --port 30000 --log-level warning > $OUT/server.log 2>&1 &
SERVER=$!
for i in $(seq 120); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done; echo "server up after ${i}s"
timeout 210 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok $DATA --disable-tqdm \
  --output-file $OUT/serving.jsonl 2>&1 | tail -32 | tee $OUT/serving.log
curl -s localhost:30000/get_server_info | python3 -c "import json,sys; d=json.load(sys.stdin); print({k: v for k, v in d.items() if 'kv' in k or 'running' in k or 'token' in k})"
kill $SERVER; sleep 3
timeout 100 python3 benchmarks/hf_batch_generate.py --model-config $CFG --tokenizer .gpu/tok $DATA --hf-num-prompts 64 \
  --batch-size 64 --output-file $OUT/hf_serving.jsonl 2>&1 | tail -2 | tee $OUT/hf_serving.log
