# Device call 3 (carry .whl .gpu/a .gpu/tok): bench_serving on the Llama-3-8B-shaped server, overlapped decode
cd .gpu/src 2>/dev/null && ln -sfn ../../.whl .whl && mkdir -p .gpu && for d in a b tok; do ln -sfn ../../$d .gpu/$d; done
# off then on (same workload as run2.sh); keeps the first GGUF part in /tmp for run2.sh's engine checks.
set -o pipefail
cp .gpu/a/part_aa /tmp/part_aa
source benchmarks/gpu/setup.sh
CFG=benchmarks/configs/llama3-8b.json
DATA="--dataset-name random --num-prompts 1000 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5"
for MODE in --disable-overlap-schedule ""; do
  python3 -m braid.launch_server --model-path llama3-8b-dummy --load-format dummy --model-config $CFG --tokenizer-path .gpu/tok \
    --dtype bfloat16 --cuda-graph-max-bs 256 --port 30000 --log-level warning $MODE > $OUT/server${MODE:+_sync}.log 2>&1 &
  SERVER=$!
  for i in $(seq 120); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done; echo "server ${MODE:-overlap} up after ${i}s"
  timeout 150 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok $DATA --disable-tqdm \
    --output-file $OUT/serving${MODE:+_sync}.jsonl 2>&1 | grep -E "Successful|duration|Output token|Mean \(ms\)|Median \(ms\)" | tee $OUT/serving${MODE:+_sync}.log
  curl -s localhost:30000/get_server_info | python3 -c "import json,sys; d=json.load(sys.stdin); print({k: d[k] for k in ('num_running_reqs', 'kv_used_tokens', 'num_decode_overlapped', 'num_forward_decode')})"
  kill $SERVER; wait $SERVER 2>/dev/null; sleep 2
done
