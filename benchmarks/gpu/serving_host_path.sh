# The scheduler's host path in ShareGPT serving (issue 14): the Llama-3-8B-shaped dummy bf16 server
# (always started with --cuda-graph-max-bs 256 before CONFIG, so "" means graphs to 256 and a cap of 256, and
# "--cuda-graph-max-bs 512" the runtime's own defaults since 3050624), bench_serving ShareGPT lengths (--seed 7,
# NUM_PROMPTS default 3000, all at once), once per CONFIG (extra launch_server flags), all in one call so the
# configurations compare on one machine. Default configs:
#   "--num-continuous-decode-steps 1"      the waiting queue looked at every decode step (the default before c2dd4a8)
#   ""                                     cap 256, graphs to 256, the runtime's admission pacing
#   "--max-running-requests 512 --cuda-graph-max-bs 512"   twice the running requests, graphed
# Per run: the bench_serving figures, then from /get_server_info the scheduler's own clocks over the run, per forward
# pass: host ms (step() outside the model's forward and device waits), forward-launch ms, device-wait ms, send ms;
# decode/extend passes, chained (overlapped) decode passes, retractions, the effective max_running_requests; and the
# idle server's load (0 running, 0 KV tokens used). A table and PASS/FAIL lines (14,500 output tok/s; clean end) last.
# DATASET=random1k runs the random 1000 x 1024 / 256 (range 0.5) workload of bench_serving_random_1k.sh instead
# (the one that must not get slower). carry: .whl .gpu/tok
#   NUM_PROMPTS=3000 bash benchmarks/gpu/serving_host_path.sh ["CONFIG" ...]
#   DATASET=random1k bash benchmarks/gpu/serving_host_path.sh "--max-running-requests 256" ""
set -o pipefail
[ $# -gt 0 ] || set -- "--num-continuous-decode-steps 1" "" "--max-running-requests 512 --cuda-graph-max-bs 512"
source benchmarks/gpu/setup.sh
trap stop_server EXIT
BUDGET_S=${BUDGET_S:-540}
if [ "${DATASET:-sharegpt}" = random1k ]; then
  DATA_FLAGS="--dataset-name random --num-prompts 1000 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5"
else
  DATA_FLAGS="--dataset-name sharegpt --num-prompts ${NUM_PROMPTS:-3000}"
fi
echo "workload: $DATA_FLAGS --seed 7 (all at once)"
START=$(date +%s)
: >"$OUT/serving.jsonl"
: >"$OUT/host.jsonl"
RUN=0
for CONFIG in "$@"; do
  RUN=$((RUN + 1))
  if [ $(( $(date +%s) - START )) -gt $((BUDGET_S - 150)) ]; then
    echo "SKIP config '${CONFIG}': under 150 s of the ${BUDGET_S} s budget left"
    echo '{"skipped": true}' >>"$OUT/host.jsonl"; echo '{"skipped": true}' >>"$OUT/serving.jsonl"
    continue
  fi
  echo "=== server flags: --cuda-graph-max-bs 256 ${CONFIG:-(defaults)}"
  # shellcheck disable=SC2086
  if ! start_dummy_server 30000 "$OUT/server_$RUN.log" --cuda-graph-max-bs 256 $CONFIG; then
    echo '{"failed": "server start"}' >>"$OUT/host.jsonl"; echo '{"failed": true}' >>"$OUT/serving.jsonl"
    stop_server; continue
  fi
  curl -s localhost:30000/get_server_info >"$OUT/before_$RUN.json"
  # shellcheck disable=SC2086
  timeout 260 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok $DATA_FLAGS \
    --seed 7 --disable-tqdm --output-file "$OUT/serving_$RUN.jsonl" 2>&1 \
    | grep -E "Successful|duration|Output token throughput|Request throughput|Mean TPOT|Median TPOT|Mean TTFT" \
    | tee -a "$OUT/serving.log"
  tail -1 "$OUT/serving_$RUN.jsonl" >>"$OUT/serving.jsonl" 2>/dev/null || echo '{"failed": true}' >>"$OUT/serving.jsonl"
  sleep 2
  curl -s localhost:30000/get_server_info >"$OUT/after_$RUN.json"
  python3 - "$OUT/before_$RUN.json" "$OUT/after_$RUN.json" >>"$OUT/host.jsonl" <<'PY'
import json, sys
b, a = (json.load(open(p)) for p in sys.argv[1:3])
d = lambda k: (a.get(k) or 0) - (b.get(k) or 0)
passes = max(d("num_forward_decode") + d("num_forward_extend"), 1)
host = d("step_time_s_total") - d("forward_time_s_total") - d("device_wait_s_total")
print(json.dumps({"host_ms": 1e3 * host / passes, "forward_ms": 1e3 * d("forward_time_s_total") / passes,
                  "wait_ms": 1e3 * d("device_wait_s_total") / passes, "send_ms": 1e3 * d("send_time_s_total") / passes,
                  "decode": d("num_forward_decode"), "extend": d("num_forward_extend"),
                  "overlapped": d("num_decode_overlapped"), "retractions": d("num_retractions"),
                  "max_running": a.get("effective_max_running_requests"), "end_running": a.get("num_running_reqs"),
                  "end_kv_used": a.get("kv_used_tokens"), "has_clocks": "step_time_s_total" in a}))
PY
  tail -1 "$OUT/host.jsonl"
  stop_server
done
python3 - "$OUT/serving.jsonl" "$OUT/host.jsonl" "${DATASET:-sharegpt}" "$@" <<'PY'
import json, sys
dataset = sys.argv.pop(3)
serving = [json.loads(l) for l in open(sys.argv[1])]
host = [json.loads(l) for l in open(sys.argv[2])]
print("per forward pass: host = scheduler step() outside the model's forward and device waits; fwd = launching the "
      "pass; wait = waiting for its results; send = building, encoding and sending the output batch")
print(f"{'server flags':<44}{'out tok/s':>10}{'TPOT':>7}{'TTFT s':>8}{'cap':>6}{'decode':>8}{'extend':>8}{'chained':>8}"
      f"{'retr':>6}{'host':>7}{'fwd':>7}{'wait':>7}{'send':>7}{'end run/kv':>12}")
ok = True
for cfg, s, h in zip(sys.argv[3:], serving, host):
    name = cfg or "(defaults)"
    if "output_throughput" not in s or "decode" not in h:
        print(f"{name:<44} not run ({s}, {h})"); ok = False
        continue
    print(f"{name:<44}{s['output_throughput']:>10.0f}{s['mean_tpot_ms']:>7.1f}{s['mean_ttft_ms'] / 1e3:>8.1f}"
          f"{h['max_running']!s:>6}{h['decode']:>8}{h['extend']:>8}{h['overlapped']:>8}{h['retractions']:>6}"
          f"{h['host_ms']:>7.2f}{h['forward_ms']:>7.2f}{h['wait_ms']:>7.2f}{h['send_ms']:>7.2f}"
          f"{str(h['end_running']) + '/' + str(h['end_kv_used']):>12}")
for cfg, s, h in zip(sys.argv[3:], serving, host):
    if "output_throughput" not in s or "decode" not in h:
        continue
    name = cfg or "(defaults)"
    if dataset != "sharegpt":  # random1k: the fixed cap of 256 (the first config) is the floor
        base = serving[0].get("output_throughput") if serving else None
        target = base is not None and s["output_throughput"] >= 0.97 * base
        print(f"{'PASS' if target else 'FAIL'} {name}: {s['output_throughput']:.0f} output tok/s "
              f"(not slower than the first config's {base or 0:.0f}, 3% call noise allowed)")
        target = None
    else:
        target = s["output_throughput"] >= 14500
    clean = h["end_running"] == 0 and h["end_kv_used"] == 0 and s.get("completed") == s.get("num_prompts")
    if target is not None:
        print(f"{'PASS' if target else 'FAIL'} {name}: {s['output_throughput']:.0f} output tok/s (target 14,500)")
    print(f"{'PASS' if clean else 'FAIL'} {name}: {s.get('completed')}/{s.get('num_prompts')} completed, "
          f"idle server at {h['end_running']} running / {h['end_kv_used']} KV tokens used")
PY
