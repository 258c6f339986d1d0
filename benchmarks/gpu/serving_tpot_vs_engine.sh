# Serving TPOT against the engine's own decode step (issue 14's Show: "TPOT at a steady batch within 1.3x of
# bench_one_batch's decode step at that batch size and context; the 16 req/s run's TPOT within 1.3x of the matching
# engine step"), Llama-3-8B-shaped dummy bf16 at the runtime's defaults, in one call (~6 min). carry: .whl .gpu/tok
#   [SERVER_FLAGS="--cuda-graph-max-extend-tokens 4096"] [RUNS="--num-prompts 1000 --request-rate 16"] \
#     bash benchmarks/gpu/serving_tpot_vs_engine.sh          (RUNS: bench_serving flag sets, ';' between them)
# 1. ShareGPT 1000 prompts at 16 req/s (Poisson, --seed 7), then 3000 all at once (its running batch sits at the cap);
#    each run's mean decoding batch as the server counted it (decode tokens / decode passes, from /get_server_info
#    before and after; Little's law on the client's figures, output tok/s x mean TPOT, printed beside it: mean TPOT
#    weighs every request alike, so short requests, whose few tokens each absorb a whole extend pass, pull it up) and
#    its mean context (ShareGPT's mean prompt plus half its mean output);
# 2. bench_one_batch at those batch sizes and contexts (128 output tokens, CUDA graphs as the server has them);
# then per run TPOT / engine step, PASS/FAIL at 1.3x. TPOT counts the prefills between decode steps too.
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
  # shellcheck disable=SC2086
  timeout 200 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok --dataset-name sharegpt \
    $run --seed 7 --disable-tqdm --output-file "$OUT/run.jsonl" 2>&1 \
    | grep -E "Successful|duration|Output token throughput|Mean TPOT|Mean TTFT|Mean input|Mean output" \
    | tee -a "$OUT/serving.log"
  tail -1 "$OUT/run.jsonl" >>"$OUT/serving.jsonl" 2>/dev/null || echo '{"failed": true}' >>"$OUT/serving.jsonl"
  sleep 2
  curl -s localhost:30000/get_server_info >"$OUT/after_$RUN_INDEX.json"
  curl -s localhost:30000/metrics >"$OUT/metrics_after_$RUN_INDEX.txt"
  server_counters 30000
done
stop_server
echo "=== engine steps at $(( $(date +%s) - START )) s"
python3 - "$OUT" <<'PY'
import json, subprocess, sys
out = sys.argv[1]
runs = [json.loads(line) for line in open(f"{out}/serving.jsonl")]
plan = []
for i, r in enumerate(runs, 1):
    if "mean_tpot_ms" not in r:
        plan.append(None)
        continue
    little = r["output_throughput"] * r["mean_tpot_ms"] / 1e3
    b, a = (json.load(open(f"{out}/{when}_{i}.json")) for when in ("before", "after"))
    d = lambda k: (a.get(k) or 0) - (b.get(k) or 0)
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
    prompt = r["total_input_tokens"] / r["completed"]
    output = r["total_output_tokens"] / r["completed"]
    plan.append((min(max(1, round(counted)), 512), int(prompt + output / 2)))
json.dump(plan, open(f"{out}/plan.json", "w"))
print("per run (decoding batch, mean context):", plan)
PY
PLAN=$(python3 -c "import json; print(' '.join(f'{b}:{c}' for b, c in (p for p in json.load(open('$OUT/plan.json')) if p)))")
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
print(f"{'run':<28}{'out tok/s':>10}{'TPOT ms':>9}{'batch':>7}{'context':>9}{'step ms':>9}{'ratio':>7}")
for name, r, p in zip(("ShareGPT 1000 at 16 req/s", "ShareGPT 3000 at once"), runs, plan):
    if p is None or tuple(p) not in steps:
        print(f"FAIL {name}: no figures")
        continue
    step = steps[tuple(p)]
    ratio = r["mean_tpot_ms"] / step
    print(f"{name:<28}{r['output_throughput']:>10.0f}{r['mean_tpot_ms']:>9.1f}{p[0]:>7}{p[1]:>9}{step:>9.2f}{ratio:>7.2f}")
    print(("PASS" if ratio <= 1.3 else "FAIL") + f" {name}: TPOT {ratio:.2f}x the engine's step (target <= 1.3x; "
          f"median TPOT {r.get('median_tpot_ms', float('nan')):.1f} ms: {r.get('median_tpot_ms', float('nan')) / step:.2f}x)")
PY
echo "done in $(( $(date +%s) - START )) s"
