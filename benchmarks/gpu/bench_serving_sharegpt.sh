# bench_serving on a Llama-3-8B-shaped dummy bf16 server (--cuda-graph-max-bs 256): synthetic ShareGPT lengths
# (--seed 7), NUM_PROMPTS (default 3000) all at once; once per CONFIG (extra launch_server flags, "" for the
# defaults), all in one call so the configurations compare on one machine. carry: .whl .gpu/tok
#   NUM_PROMPTS=3000 bash benchmarks/gpu/bench_serving_sharegpt.sh "" "--enable-mixed-chunk"
set -o pipefail
[ $# -gt 0 ] || set -- ""
source benchmarks/gpu/setup.sh
trap stop_server EXIT
RUN=0
for CONFIG in "$@"; do
  RUN=$((RUN + 1))
  echo "=== server flags: --cuda-graph-max-bs 256 ${CONFIG:-(defaults)}"
  # shellcheck disable=SC2086
  start_dummy_server 30000 "$OUT/server_$RUN.log" --cuda-graph-max-bs 256 $CONFIG || { stop_server; continue; }
  timeout 240 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok --dataset-name sharegpt \
    --num-prompts "${NUM_PROMPTS:-3000}" --seed 7 --disable-tqdm --output-file "$OUT/serving.jsonl" 2>&1 \
    | grep -E "Successful|duration|Output token throughput|Request throughput|Mean TPOT|Median TPOT|Mean TTFT|Mean \(ms\)" \
    | tee -a "$OUT/serving.log"
  server_counters 30000
  stop_server
done
python3 - "$OUT/serving.jsonl" "$@" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'server flags':<62}{'out tok/s':>11}{'req/s':>8}{'TPOT ms':>9}{'TTFT ms':>10}")
for cfg, r in zip(sys.argv[2:], rows):
    print(f"{(cfg or '(defaults)'):<62}{r['output_throughput']:>11.1f}{r['request_throughput']:>8.2f}"
          f"{r['mean_tpot_ms']:>9.1f}{r['mean_ttft_ms']:>10.1f}")
PY
