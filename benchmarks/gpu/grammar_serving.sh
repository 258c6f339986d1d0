# JSON-schema constrained against free generation on a Llama-3-8B-shaped dummy bf16 server (benchmarks/grammar_serving.py:
# a burst of 64 new schemas from one client; 512 requests at once over 64 schemas, then the same prompts free with
# each one's output length, twice (a cost only the first constrained round pays shows as its ratio); the same at 64,
# streamed, for the time per output token), once per grammar engine named (default: llguidance), each optionally
# with server flags after commas. Prints the card's copy rate first.
# carry: .whl .gpu/tok
#   bash benchmarks/gpu/grammar_serving.sh llguidance outlines llguidance,--enable-jump-forward
set -o pipefail
[ $# -gt 0 ] || set -- llguidance
source benchmarks/gpu/setup.sh
trap stop_server EXIT
python3 - <<'PY' 2>&1 | tee "$OUT/copy_rate.log"
import torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); [y.copy_(x) for _ in range(20)]; e.record(); torch.cuda.synchronize()
print(f"{torch.cuda.get_device_name()}: copy rate {2 * 20 * x.numel() / (s.elapsed_time(e) / 1e3) / 1e12:.2f} TB/s")
PY
for VARIANT in "$@"; do
  IFS=, read -r ENGINE FLAGS <<<"$VARIANT"
  NAME=$(echo "$VARIANT" | tr -c 'a-zA-Z0-9\n' '_')
  echo "=== --grammar-backend $ENGINE ${FLAGS//,/ }" | tee -a "$OUT/grammar_serving.log"
  # shellcheck disable=SC2086
  start_dummy_server 30000 "$OUT/server_$NAME.log" --cuda-graph-max-bs 512 --max-running-requests 512 \
    --grammar-backend "$ENGINE" ${FLAGS//,/ } || { stop_server; continue; }
  timeout 400 python3 benchmarks/grammar_serving.py --port 30000 --num-requests 512 --num-schemas 64 \
    --max-tokens 128 --tpot-batch 64 --throughput-rounds 2 --output-file "$OUT/grammar_serving_$NAME.json" 2>&1 \
    | tail -14 \
    | tee -a "$OUT/grammar_serving.log"
  server_counters 30000
  stop_server
done
