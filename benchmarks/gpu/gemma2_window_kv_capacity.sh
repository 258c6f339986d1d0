# Gemma-2's hybrid KV pool on the H200: window layers' KV released once out of every request's window
# (--disable-window-kv-trimming keeps one pool), Gemma-2-9B-shaped dummy model, bf16, same memory budget both ways.
#   1. the pool's tests (CPU ones and the compiled Triton kernels over the slot map) and the GPU engine test
#   2. per mode (trimmed, untrimmed; Triton, and FlashInfer when it imports): pool capacity in tokens (full-layer
#      slots, 8,192-token requests that fit) and 8 requests x 8,000 prompt tokens decoded 128 tokens through the
#      scheduler (decode tokens/s; peak pool usage sampled while they run)
# carry: .whl .gpu/tok (SmolLM2's tokenizer folder; the model's vocabulary is larger, prompts are token ids)
#   bash benchmarks/gpu/gemma2_window_kv_capacity.sh        (~6 min)
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
[ -d .gpu/tok ] || { echo "FAIL: no .gpu/tok (carry SmolLM2's tokenizer folder, see setup.sh)"; exit 1; }
RESULT="$OUT/window_kv.jsonl"
rm -f "$RESULT"

timeout 150 python3 -m pytest tests/runtime/test_window_kv_pool.py tests/kernels/test_window_kv_triton.py -q -x \
  -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.log"
grep -q " passed" "$OUT/tests.log" && ! grep -q "failed\|error" "$OUT/tests.log" && echo "PASS tests" || echo "FAIL tests"

BACKENDS=triton
python3 -c "import flashinfer" >/dev/null 2>&1 && BACKENDS="triton flashinfer"
for BACKEND in $BACKENDS; do
  for MODE in trimmed untrimmed; do
    [ "$BACKEND" = flashinfer ] && [ "$MODE" = untrimmed ] && continue  # the capacity split does not depend on it
    timeout 170 python3 benchmarks/gpu/gemma2_window_kv_capacity.py $MODE "$RESULT" --attention-backend $BACKEND \
      2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/runs.log" || echo "FAIL $MODE $BACKEND did not finish"
  done
done

python3 - "$RESULT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if open(sys.argv[1]).read().strip() else []
by = {(r["mode"], r["attention_backend"]): r for r in rows}
print()
print(f"{'mode':10} {'backend':10} {'pool GiB':>8} {'full tok':>9} {'window tok':>10} {'8K reqs':>7} {'decode tok/s':>12} "
      f"{'peak used':>9} {'peak window':>11}")
for r in rows:
    print(f"{r['mode']:10} {r['attention_backend']:10} {r['kv_pool_bytes'] / 2**30:8.1f} {r['full_tokens']:9d} "
          f"{r['window_tokens']:10d} {r['requests_8k_fit']:7d} {r['decode_tok_s']:12.1f} {r['peak_kv_used'] or 0:9d} "
          f"{r['peak_window_used'] or 0:11d}")
t, u = by.get(("trimmed", "triton")), by.get(("untrimmed", "triton"))
if not (t and u):
    print("FAIL: a run is missing (see runs.log)")
    sys.exit(0)
same = abs(t["kv_pool_bytes"] - u["kv_pool_bytes"]) <= 0.02 * u["kv_pool_bytes"]
ratio = t["tokens_8k_fit"] / max(u["tokens_8k_fit"], 1)
print(f"{'PASS' if same else 'FAIL'} same KV bytes both ways: {t['kv_pool_bytes'] / 2**30:.2f} vs "
      f"{u['kv_pool_bytes'] / 2**30:.2f} GiB")
print(f"{'PASS' if ratio >= 1.3 else 'FAIL'} capacity at 8K contexts: {t['tokens_8k_fit']} vs {u['tokens_8k_fit']} tokens "
      f"({ratio:.2f}x, >= 1.3x wanted); full-layer slots {t['full_tokens']} vs {u['full_tokens']} "
      f"({t['full_tokens'] / u['full_tokens']:.2f}x)")
for r in (x for x in rows if x["mode"] == "trimmed"):
    ok = r["peak_window_used"] is not None and r["peak_window_used"] <= r["window_bound_8x"]
    print(f"{'PASS' if ok else 'FAIL'} {r['attention_backend']}: window slots in use while 8 x 8K run: "
          f"peak {r['peak_window_used']} <= {r['window_bound_8x']} (8 windows + one extend batch); full slots peak "
          f"{r['peak_kv_used']}")
for r in rows:
    ok = r["idle_kv_used"] == 0 and r["idle_window_used"] == 0
    print(f"{'PASS' if ok else 'FAIL'} {r['mode']} {r['attention_backend']}: pool free of requests when idle")
speed = t["decode_tok_s"] / u["decode_tok_s"]
print(f"{'PASS' if speed >= 0.95 else 'FAIL'} decode at 8K batch 8: {t['decode_tok_s']:.1f} vs {u['decode_tok_s']:.1f} "
      f"tok/s trimmed/untrimmed ({speed:.3f}x, >= 0.95 wanted: the slot translation costs little)")
PY
