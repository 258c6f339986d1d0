# Device call 7 of session 4 (carry .whl .gpu/tok): bench_serving (the run2.sh workload) with more requests decoding
# at once than the default cap of 256: max_running_requests 1024, CUDA graphs up to batch 512.
set -o pipefail
source benchmarks/gpu/setup.sh
CFG=benchmarks/configs/llama3-8b.json
DATA="--dataset-name random --num-prompts 1000 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5"
for MRR in 1024; do
  python3 -m braid.launch_server --model-path llama3-8b-dummy --load-format dummy --model-config $CFG --tokenizer-path .gpu/tok \
    --dtype bfloat16 --cuda-graph-max-bs 512 --max-running-requests $MRR --port 30000 --log-level warning > $OUT/server_$MRR.log 2>&1 &
  SERVER=$!
  for i in $(seq 150); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done; echo "server mrr=$MRR up after ${i}s"
  timeout 150 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok $DATA --disable-tqdm \
    --output-file $OUT/serving_$MRR.jsonl 2>&1 | grep -E "Successful|duration|Output token|Mean \(ms\)|Median \(ms\)" | tee $OUT/serving_$MRR.log
  curl -s localhost:30000/get_server_info | python3 -c "import json,sys; d=json.load(sys.stdin); print({k: d[k] for k in ('num_running_reqs', 'kv_used_tokens', 'num_decode_overlapped', 'num_forward_decode', 'num_forward_extend', 'num_retractions')})"
  kill $SERVER; wait $SERVER 2>/dev/null; sleep 2
done
