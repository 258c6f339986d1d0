# Serving TPOT against the engine's own decode step (issue 14's Show: "TPOT at a steady batch within 1.3x of
# bench_one_batch's decode step at that batch size and context; the 16 req/s run's TPOT within 1.3x of the matching
# engine step"), Llama-3-8B-shaped dummy bf16 at the runtime's defaults, in one call (~6 min). carry: .whl .gpu/tok
#   [SERVER_FLAGS="--cuda-graph-max-extend-tokens 4096"] [RUNS="--num-prompts 1000 --request-rate 16"] \
#     bash benchmarks/gpu/serving_tpot_vs_engine.sh          (RUNS: bench_serving flag sets, ';' between them)
# 1. ShareGPT 1000 prompts at 16 req/s (Poisson, --seed 7), then 3000 all at once (its running batch sits at the cap);
#    the server's counters sampled twice a second give each run's steady phase (while requests wait, else while any
#    run): its time-weighted running batch, mean context (KV held / running) and time per token (running x seconds /
#    tokens generated, so the extend passes between decode steps count; also without them, from the server's
#    extend_time_s_total: what the decode passes alone cost). Printed beside it: the mean decode tokens per
#    pass (weighs the tail's many small, fast passes alike, so it sits below the steady batch), Little's law on the
#    client's figures, and the HTTP server's per-token histogram against the client's ITL (a gap there is the client's);
# 2. bench_one_batch at each steady batch and context (128 output tokens, CUDA graphs as the server has them);
# then per run the steady time per token / engine step, PASS/FAIL at 1.3x, with the client's mean and median TPOT over
# the step beside it (those weigh every request alike: short requests, whose few tokens each absorb an extend, pull
# them up).
set -o pipefail
source benchmarks/gpu/setup.sh
trap stop_server EXIT
nvidia-smi -L
START=$(date +%s)
: >"$OUT/serving.jsonl"
echo "server flags: ${SERVER_FLAGS:-(defaults)}"
# shellcheck disable=SC2086
start_dummy_server 30000 "$OUT/server.log" ${SERVER_FLAGS:-} || exit 1
IFS=';' read -r -a RUN_LIST <<<"${RUNS:---num-prompts 1000 --request-rate 16;--num-prompts 3000}"
RUN_INDEX=0
for run in "${RUN_LIST[@]}"; do
  RUN_INDEX=$((RUN_INDEX + 1))
  curl -s localhost:30000/get_server_info >"$OUT/before_$RUN_INDEX.json"
  curl -s localhost:30000/metrics >"$OUT/metrics_before_$RUN_INDEX.txt"
  echo "=== ShareGPT $run"
  # the server's counters twice a second while the run lasts: the steady phase is read from them below
  python3 - "$OUT/samples_$RUN_INDEX.jsonl" <<'PY' &
import json, sys, time, urllib.request
with open(sys.argv[1], "w") as f:
    while True:
        try:
            d = json.load(urllib.request.urlopen("http://localhost:30000/get_server_info", timeout=5))
        except OSError:
            break
        keep = ("num_running_reqs", "num_waiting_reqs", "num_generated_tokens_total", "kv_used_tokens",
                "extend_time_s_total")
        f.write(json.dumps({"t": time.monotonic(), **{k: d.get(k, 0) for k in keep}}) + "\n")
        f.flush()
        time.sleep(0.5)
PY
  SAMPLER_PID=$!
  # shellcheck disable=SC2086
  timeout 200 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok --dataset-name sharegpt \
    $run --seed 7 --disable-tqdm --output-file "$OUT/run.jsonl" 2>&1 \
    | grep -E "Successful|duration|Output token throughput|Mean TPOT|Mean TTFT|Mean input|Mean output" \
    | tee -a "$OUT/serving.log"
  tail -1 "$OUT/run.jsonl" >>"$OUT/serving.jsonl" 2>/dev/null || echo '{"failed": true}' >>"$OUT/serving.jsonl"
  sleep 2
  kill "$SAMPLER_PID" 2>/dev/null
  curl -s localhost:30000/get_server_info >"$OUT/after_$RUN_INDEX.json"
  curl -s localhost:30000/metrics >"$OUT/metrics_after_$RUN_INDEX.txt"
  server_counters 30000
done
stop_server
echo "=== engine steps at $(( $(date +%s) - START )) s"
python3 - "$OUT" "${RUN_LIST[@]}" <<'PY'
import json, sys
out, RUN_NAMES = sys.argv[1], sys.argv[2:]
runs = [json.loads(line) for line in open(f"{out}/serving.jsonl")]
plan = []
for i, r in enumerate(runs, 1):
    if "mean_tpot_ms" not in r:
        plan.append(None)
        continue
    little = r["output_throughput"] * r["mean_tpot_ms"] / 1e3
    before, after = (json.load(open(f"{out}/{when}_{i}.json")) for when in ("before", "after"))
    d = lambda k: (after.get(k) or 0) - (before.get(k) or 0)
    # each request's first token comes from its extend pass
    decode_tokens = d("num_generated_tokens_total") - r["completed"]
    counted = decode_tokens / max(d("num_forward_decode"), 1)
    pass_ms = 1e3 * d("step_time_s_total") / max(d("num_forward_decode") + d("num_forward_extend"), 1)
    print(f"run {i}: decoding batch {counted:.0f} as counted ({d('num_forward_decode')} decode passes, "
          f"{d('num_forward_extend')} extends, {pass_ms:.2f} ms of step() per pass), {little:.0f} by Little's law")
    # where a token's time goes: the HTTP server's own per-token histogram (as outputs reach it) against the
    # client's inter-token latency, both token-weighted; a gap is the client's or the wire's
    def token_seconds(path):
        found = {}
        for line in open(path):
            for key in ("sum", "count"):
                if line.split("{")[0].endswith(f"time_per_output_token_seconds_{key}"):
                    found[key] = float(line.rsplit(" ", 1)[1])
        return found
    try:
        m0, m1 = token_seconds(f"{out}/metrics_before_{i}.txt"), token_seconds(f"{out}/metrics_after_{i}.txt")
        server_ms = 1e3 * (m1["sum"] - m0["sum"]) / max(m1["count"] - m0["count"], 1)
        print(f"run {i}: time per token at the HTTP server {server_ms:.2f} ms, client mean ITL "
              f"{r.get('mean_itl_ms', float('nan')):.2f} ms, mean TPOT {r['mean_tpot_ms']:.2f} ms")
    except (OSError, KeyError, ValueError):
        print(f"run {i}: no per-token histogram in /metrics")
    # the steady phase from the server's samples: while requests wait (the running batch held at its cap), else
    # while any run; per token R dt / tokens over it (extend passes between decode steps included), its mean
    # batch weighted by time (mean decode tokens per pass weighs the tail's many small fast passes alike) and its
    # mean context (KV held / running)
    try:
        samples = [json.loads(line) for line in open(f"{out}/samples_{i}.jsonl")]
    except (OSError, ValueError):
        samples = []
    spans = list(zip(samples, samples[1:]))
    queued = [(a, b) for a, b in spans if a["num_waiting_reqs"] > 0 and b["num_waiting_reqs"] > 0]
    steady = queued if len(queued) >= 10 else [(a, b) for a, b in spans if a["num_running_reqs"] > 0]
    if len(steady) < 4:
        print(f"run {i}: too few samples of the server's counters ({len(samples)}) for a steady phase")
        plan.append(None)
        continue
    held = sum((a["num_running_reqs"] + b["num_running_reqs"]) / 2 * (b["t"] - a["t"]) for a, b in steady)
    seconds = sum(b["t"] - a["t"] for a, b in steady)
    tokens = sum(b["num_generated_tokens_total"] - a["num_generated_tokens_total"] for a, b in steady)
    batch = held / seconds
    context = sum(a["kv_used_tokens"] for a, _ in steady) / max(sum(a["num_running_reqs"] for a, _ in steady), 1)
    per_token_ms = 1e3 * held / max(tokens, 1)
    # the same without the extend passes (the prefill the workload brings): what the decode passes alone cost
    extend_share = sum(b["extend_time_s_total"] - a["extend_time_s_total"] for a, b in steady) / seconds
    decode_ms = per_token_ms * (1 - extend_share)
    print(f"run {i}: steady phase ({'queue non-empty' if steady is queued else 'any running'}) {seconds:.1f} s: "
          f"batch {batch:.0f} (time-weighted), context {context:.0f}, {per_token_ms:.2f} ms per token, of which "
          f"extend passes {per_token_ms - decode_ms:.2f} ms ({100 * extend_share:.0f}% of the time)")
    plan.append(dict(name=f"ShareGPT {RUN_NAMES[i - 1]}", batch=min(max(1, round(batch)), 512),
                     context=int(context), steady_ms=per_token_ms, decode_ms=decode_ms))
json.dump(plan, open(f"{out}/plan.json", "w"))
print("per run (steady batch, context):", [(p["batch"], p["context"]) for p in plan if p])
PY
PLAN=$(python3 -c "import json; print(' '.join(f'{p[\"batch\"]}:{p[\"context\"]}' for p in json.load(open('$OUT/plan.json')) if p))")
for item in $PLAN; do
  bs=${item%%:*}; ctx=${item##*:}
  timeout 150 python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
    --model-path llama3-8b-dummy --dtype bfloat16 --batch-size "$bs" --input-len "$ctx" --output-len 128 \
    --cuda-graph-max-bs 512 --result-filename "$OUT/engine.jsonl" 2>&1 | grep -v Warning | tail -3
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = [json.loads(line) for line in open(f"{out}/serving.jsonl")]
plan = json.load(open(f"{out}/plan.json"))
engine = [json.loads(line) for line in open(f"{out}/engine.jsonl")] if os.path.exists(f"{out}/engine.jsonl") else []
steps = {(e["batch_size"], e["input_len"]): e["median_decode_latency_s"] * 1e3 for e in engine}
print(f"{'run':<34}{'out tok/s':>10}{'steady ms/tok':>14}{'w/o extends':>12}{'TPOT ms':>9}{'batch':>7}"
      f"{'context':>9}{'step ms':>9}{'ratio':>7}{'w/o ext':>8}")
for r, p in zip(runs, plan):
    if p is None or (p["batch"], p["context"]) not in steps:
        print("FAIL: no figures for", p and p["name"])
        continue
    step = steps[(p["batch"], p["context"])]
    ratio = p["steady_ms"] / step
    print(f"{p['name']:<34}{r['output_throughput']:>10.0f}{p['steady_ms']:>14.2f}{p['decode_ms']:>12.2f}"
          f"{r['mean_tpot_ms']:>9.1f}{p['batch']:>7}{p['context']:>9}{step:>9.2f}{ratio:>7.2f}"
          f"{p['decode_ms'] / step:>8.2f}")
    print(("PASS" if ratio <= 1.3 else "FAIL") + f" {p['name']}: time per token at the steady batch {ratio:.2f}x the "
          f"engine's step (target <= 1.3x; without the extend passes between decode steps "
          f"{p['decode_ms'] / step:.2f}x); the client's mean TPOT {r['mean_tpot_ms'] / step:.2f}x, median "
          f"{r.get('median_tpot_ms', float('nan')) / step:.2f}x")
PY
echo "done in $(( $(date +%s) - START )) s"
