# bench_serving on a Llama-3-8B-shaped dummy bf16 server (--cuda-graph-max-bs 256): 1000 random prompts, 1024 in /
# 256 out, range 0.5, all at once; once per CONFIG (extra launch_server flags, "" for the defaults). --hf-peer adds
# HF batch generation of the first 64 of the same prompts (benchmarks/hf_batch_generate.py). carry: .whl .gpu/tok
#   bash benchmarks/gpu/bench_serving_random_1k.sh --hf-peer
#   bash benchmarks/gpu/bench_serving_random_1k.sh "--disable-overlap-schedule" ""
#   bash benchmarks/gpu/bench_serving_random_1k.sh "--max-running-requests 1024 --cuda-graph-max-bs 512"
set -o pipefail
HF_PEER=0
[ "$1" = --hf-peer ] && { HF_PEER=1; shift; }
[ $# -gt 0 ] || set -- ""
source benchmarks/gpu/setup.sh
trap stop_server EXIT
DATA="--dataset-name random --num-prompts 1000 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5"
RUN=0
for CONFIG in "$@"; do
  RUN=$((RUN + 1))
  echo "=== server flags: --cuda-graph-max-bs 256 ${CONFIG:-(defaults)}"
  # shellcheck disable=SC2086
  start_dummy_server 30000 "$OUT/server_$RUN.log" --cuda-graph-max-bs 256 $CONFIG || { stop_server; continue; }
  # shellcheck disable=SC2086
  timeout 210 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok $DATA --disable-tqdm \
    --output-file "$OUT/serving.jsonl" 2>&1 | grep -v Warning | tail -32 | tee -a "$OUT/serving.log"
  server_counters 30000
  stop_server
done
if [ $HF_PEER = 1 ]; then
  # shellcheck disable=SC2086
  timeout 100 python3 benchmarks/hf_batch_generate.py --model-config benchmarks/configs/llama3-8b.json \
    --tokenizer .gpu/tok $DATA --hf-num-prompts 64 --batch-size 64 --output-file "$OUT/hf_serving.jsonl" 2>&1 \
    | tail -2 | tee "$OUT/hf_serving.log"
fi
