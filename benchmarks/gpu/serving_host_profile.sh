# Where the host time of a ShareGPT serving run goes (issue 14): the Llama-3-8B-shaped dummy bf16 server
# (--cuda-graph-max-bs 256 plus any extra launch_server flags given), bench_serving ShareGPT lengths (--seed 7,
# NUM_PROMPTS default 3000, all at once); PROFILE_S seconds into the run (default 30), py-spy samples the scheduler
# process and the HTTP server process for SAMPLE_S seconds (default 20) at 100 Hz. Prints, per process, the share
# of samples in each function (inclusive, and self) and the serving figures; the server's INFO stats lines are in
# $OUT/server.log. carry: .whl .gpu/tok (py-spy travels as a wheel in .whl)
#   NUM_PROMPTS=3000 bash benchmarks/gpu/serving_host_profile.sh [launch_server flags...]
set -o pipefail
source benchmarks/gpu/setup.sh
SPY=$(ls /tmp/site/bin/py-spy 2>/dev/null || command -v py-spy)
[ -x "$SPY" ] || { echo "FAIL no py-spy (carry its wheel in .whl)"; exit 1; }
trap stop_server EXIT
start_dummy_server 30000 "$OUT/server.log" --cuda-graph-max-bs 256 --log-level info "$@" || exit 1
timeout 300 python3 -m braid.bench_serving --backend braid --port 30000 --tokenizer .gpu/tok --dataset-name sharegpt \
  --num-prompts "${NUM_PROMPTS:-3000}" --seed 7 --disable-tqdm --output-file "$OUT/serving.jsonl" >"$OUT/bench.log" 2>&1 &
BENCH=$!
sleep "${PROFILE_S:-30}"
# the launcher's children: the HTTP server is the launcher itself; the scheduler (and detokenizer) its children
ps -o pid=,pcpu=,args= --ppid "$SERVER_PID" | tee "$OUT/children.txt"
SCHED=$(ps -o pid=,pcpu= --ppid "$SERVER_PID" --sort=-pcpu | head -1 | awk '{print $1}')
"$SPY" record -r 100 -d "${SAMPLE_S:-20}" -f raw -o "$OUT/scheduler.txt" -p "$SCHED" --nonblocking >/dev/null 2>&1 &
"$SPY" record -r 100 -d "${SAMPLE_S:-20}" -f raw -o "$OUT/server.txt" -p "$SERVER_PID" --nonblocking >/dev/null 2>&1 &
wait %2 %3 2>/dev/null
wait "$BENCH"
grep -E "Successful|duration|Output token throughput|Request throughput|Mean TPOT|Median TPOT|Mean TTFT" "$OUT/bench.log"
grep "stats:" "$OUT/server.log" | tail -8
server_counters 30000
for proc in scheduler server; do
  echo "=== $proc: share of samples (inclusive / self), top functions"
  python3 - "$OUT/$proc.txt" <<'PY'
import collections, sys
incl, self_, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    if not stack:
        continue
    n = int(n)
    frames = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in stack.split(";")]
    total += n
    for f in set(frames):
        incl[f] += n
    self_[frames[-1]] += n
print(f"{total} samples")
for f, n in incl.most_common(40):
    print(f"{100 * n / total:6.1f}% {100 * self_[f] / total:6.1f}%  {f[:120]}")
PY
done
