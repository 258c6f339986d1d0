# Before/after of braid's core on the H200 in one device call (issues 13 and 14), for each source tree named:
#   1. python -m braid.bench_one_batch, Llama-3-8B-shaped dummy bf16, batch 1 and 32, 128 in / 512 out
#   2. python -m braid.bench_serving --backend braid --dataset-name sharegpt --num-prompts N --seed 7 (all at once)
#      against that tree's server (--load-format dummy, --cuda-graph-max-bs 256)
# then a table. Every tree runs step 1 before any runs step 2, so a call cut short still compares the engines.
#
#   bash benchmarks/gpu/core_before_after.sh [--num-prompts N] [--budget-s S] [--model-config JSON] [--no-engine]
#     [--no-serving] [--worktree-at-defaults] TREE...
# TREE: `.` (the working tree as it travelled) or a git ref; a ref's files come from `.gpu/trees/REF` when carried,
# else from `git archive REF` when the device copy has the history. carry: .whl .gpu/tok (.gpu/trees if used).
# The bench_serving client (and so the prompts) is always the working tree's, so the servers alone differ.
# --num-prompts (default 3000: ~130 s per run at 7.3k tok/s); --budget-s (default 560): steps that would start
# past it are skipped, each step's timeout is capped to what is left. --model-config (default
# benchmarks/configs/llama3-8b.json) lets a tiny config try the script on a CPU. --no-engine skips step 1, --no-serving
# step 2;
# --worktree-at-defaults serves `.` at the runtime's defaults instead of --cuda-graph-max-bs 256 (the issue's
# baseline command, kept for the refs).
# $OUT gets results.jsonl (one line per run, "tree" field), run.log, summary.txt and server_<tree>.log.
set -o pipefail
NUM_PROMPTS=3000
BUDGET_S=560
CFG=$PWD/benchmarks/configs/llama3-8b.json
ENGINE=1
SERVING=1
WORKTREE_SERVER_FLAGS="--cuda-graph-max-bs 256"
TREES=()
while [ $# -gt 0 ]; do
  case $1 in
    --num-prompts) NUM_PROMPTS=$2; shift 2 ;;
    --budget-s) BUDGET_S=$2; shift 2 ;;
    --model-config) CFG=$(realpath "$2"); shift 2 ;;
    --no-engine) ENGINE=0; shift ;;
    --no-serving) SERVING=0; shift ;;
    --worktree-at-defaults) WORKTREE_SERVER_FLAGS=""; shift ;;
    -*) echo "unknown option $1"; exit 2 ;;
    *) TREES+=("$1"); shift ;;
  esac
done
[ ${#TREES[@]} -gt 0 ] || { echo "usage: core_before_after.sh [--num-prompts N] [--budget-s S] [--model-config JSON] [--no-engine] [--no-serving] [--worktree-at-defaults] TREE..."; exit 2; }
OUT=${OUT:-/tmp/core_before_after}
mkdir -p "$OUT"
T_START=$SECONDS
exec > >(tee -a "$OUT/run.log") 2>&1

source benchmarks/gpu/setup.sh
trap stop_server EXIT
nvidia-smi -L
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

time_left() { echo $((BUDGET_S - (SECONDS - T_START))); }
# capped_timeout WANTED: WANTED seconds, or what is left of the budget; fails when under 20 s are left
capped_timeout() {
  local left
  left=$(time_left)
  [ "$left" -ge 20 ] || { echo "skipped: ${left}s of the budget left" >&2; return 1; }
  echo $(( $1 < left ? $1 : left ))
}

label_of() { [ "$1" = . ] && echo worktree || echo "$1" | tr -c 'A-Za-z0-9._\n-' _; }

tree_dir() {  # the folder holding TREE's source files
  local ref=$1 dir
  if [ "$ref" = . ]; then echo "$PWD"; return; fi
  if [ -d ".gpu/trees/$ref" ]; then echo "$PWD/.gpu/trees/$ref"; return; fi
  dir=/tmp/braid-trees/$(label_of "$ref")
  if [ ! -d "$dir" ]; then
    git rev-parse --verify -q "$ref^{commit}" >/dev/null || {
      echo "no history for $ref here: carry .gpu/trees/$ref (git archive $ref | tar -x -C .gpu/trees/$ref)" >&2; return 1; }
    mkdir -p "$dir" && git archive "$ref" | tar -x -C "$dir" || return 1
  fi
  echo "$dir"
}

# run_in_tree TREE_DIR CMD...: CMD with TREE_DIR's braid first on the import path
run_in_tree() {
  local pkg
  pkg=$(braid_import_dir "$1") || return 1
  shift
  PYTHONPATH=/tmp/site:$pkg "$@"
}

tag_results() {  # tag_results FILE LABEL: append FILE's JSON lines to results.jsonl with "tree": LABEL
  python3 - "$1" "$2" "$OUT/results.jsonl" <<'EOF'
import json, sys
src, label, dst = sys.argv[1:]
with open(src) as f, open(dst, "a") as out:
    for line in f:
        if line.strip():
            out.write(json.dumps({"tree": label, **json.loads(line)}) + "\n")
EOF
}

declare -A DIRS
for ref in "${TREES[@]}"; do
  DIRS[$ref]=$(tree_dir "$ref") || exit 1
  echo "tree $ref: ${DIRS[$ref]} -> $(run_in_tree "${DIRS[$ref]}" python3 -c 'import braid; print(braid.__file__)')"
done

for ref in "${TREES[@]}"; do
  [ "$ENGINE" = 1 ] || break
  label=$(label_of "$ref")
  echo "=== bench_one_batch, $label ($(time_left)s of the budget left)"
  limit=$(capped_timeout 180) || continue
  rm -f "/tmp/one_batch_$label.jsonl"
  run_in_tree "${DIRS[$ref]}" timeout "$limit" python3 -m braid.bench_one_batch --load-format dummy --model-config "$CFG" \
    --model-path llama3-8b-dummy --dtype bfloat16 --cuda-graph-max-bs 32 --log-level warning --run-name "$label" \
    --batch-size 1 32 --input-len 128 --output-len 512 --result-filename "/tmp/one_batch_$label.jsonl" 2>&1 | grep -v Warning
  [ -s "/tmp/one_batch_$label.jsonl" ] && tag_results "/tmp/one_batch_$label.jsonl" "$label"
done

PORT=30000
for ref in "${TREES[@]}"; do
  [ "$SERVING" = 1 ] || break
  label=$(label_of "$ref")
  PORT=$((PORT + 1))
  echo "=== ShareGPT serving, $NUM_PROMPTS prompts, $label ($(time_left)s of the budget left)"
  SERVER_START_TIMEOUT_S=$(capped_timeout 240) || continue
  client_path=$PYTHONPATH
  export PYTHONPATH=/tmp/site:$(braid_import_dir "${DIRS[$ref]}")
  server_flags="--cuda-graph-max-bs 256"
  [ "$ref" = . ] && server_flags=$WORKTREE_SERVER_FLAGS
  echo "server flags: ${server_flags:-(defaults)}"
  # shellcheck disable=SC2086
  start_dummy_server "$PORT" "$OUT/server_$label.log" $server_flags --model-config "$CFG"
  started=$?
  export PYTHONPATH=$client_path
  [ $started = 0 ] || { stop_server; continue; }
  if limit=$(capped_timeout 400); then
    rm -f "/tmp/serving_$label.jsonl"
    timeout "$limit" python3 -m braid.bench_serving --backend braid --port "$PORT" --tokenizer .gpu/tok \
      --dataset-name sharegpt --num-prompts "$NUM_PROMPTS" --seed 7 --disable-tqdm \
      --output-file "/tmp/serving_$label.jsonl" 2>&1 | grep -v Warning
    server_counters "$PORT"
    [ -s "/tmp/serving_$label.jsonl" ] && tag_results "/tmp/serving_$label.jsonl" "$label"
  fi
  stop_server
done

python3 - "$OUT/results.jsonl" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
path = sys.argv[1]
rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
trees = list(dict.fromkeys(r["tree"] for r in rows))

def pick(tree, **match):
    return next((r for r in rows if r["tree"] == tree and all(r.get(k) == v for k, v in match.items())), None)

cols = [("decode bs1 tok/s", lambda t: pick(t, batch_size=1), "decode_throughput"),
        ("decode bs32 tok/s", lambda t: pick(t, batch_size=32), "decode_throughput"),
        ("ShareGPT out tok/s", lambda t: pick(t, dataset_name="sharegpt"), "output_throughput"),
        ("req/s", lambda t: pick(t, dataset_name="sharegpt"), "request_throughput"),
        ("mean TPOT ms", lambda t: pick(t, dataset_name="sharegpt"), "mean_tpot_ms"),
        ("mean TTFT ms", lambda t: pick(t, dataset_name="sharegpt"), "mean_ttft_ms")]
print("tree".ljust(14) + "".join(name.rjust(20) for name, _, _ in cols) + "   completed")
first = trees[0] if trees else None
for t in trees:
    cells = []
    for name, find, key in cols:
        r, r0 = find(t), find(first)
        if r is None:
            cells.append("-".rjust(20))
            continue
        ratio = f" ({r[key] / r0[key]:.3f}x)" if t != first and r0 and r0[key] else ""
        cells.append(f"{r[key]:.1f}{ratio}".rjust(20))
    serving = pick(t, dataset_name="sharegpt")
    done = f"{serving['completed']}/{serving['num_prompts']} in {serving['duration_s']:.1f}s" if serving else "-"
    print(t.ljust(14) + "".join(cells) + "   " + done)
print(f"(ratios against {first})" if len(trees) > 1 else "")
EOF
echo "total ${SECONDS}s"
