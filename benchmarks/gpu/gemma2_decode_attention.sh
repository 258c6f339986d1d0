# Gemma-2-9B decode attention alone (benchmarks/gpu/gemma2_decode_attention.py): one global layer (8,192 keys) and one
# window layer (the last 4,096 of 8,192), head_dim 256, 16/8 heads, soft-cap, bf16, batch 1 and 8; the Triton kernel
# over split counts x stage-1 configs (the runtime's choice among them), FlashInfer's decode when it imports (or was
# staged as flashinfer_vs_triton.sh describes). Prints the table last: the runtime's figure, the sweep's best, and
# the time the best would save per decode step. carry: .whl (and .gpu/fi2 on the second call of a FlashInfer staging)
#   bash benchmarks/gpu/gemma2_decode_attention.sh        (~4-7 min; the Triton sweep stops itself after 330 s)
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
ROWS="$OUT/gemma2_decode_attention.jsonl"
rm -f "$ROWS"
install_staged_flashinfer

timeout 400 python3 benchmarks/gpu/gemma2_decode_attention.py --impls triton --budget-s 330 --out "$ROWS" 2>&1 \
  | grep -v Warning > "$OUT/triton_sweep.log" || echo "FAIL Triton sweep did not finish (see triton_sweep.log)"
grep -v '^{' "$OUT/triton_sweep.log" | tail -20
if python3 -c "import flashinfer" >/dev/null 2>&1; then
  timeout 130 python3 benchmarks/gpu/gemma2_decode_attention.py --impls flashinfer --out "$ROWS" 2>&1 \
    | grep -v Warning > "$OUT/flashinfer.log" || echo "FAIL FlashInfer timing did not finish in 130 s (see flashinfer.log)"
else
  echo "SKIP flashinfer: not importable here (stage its wheel as benchmarks/gpu/flashinfer_vs_triton.sh does)"
fi
python3 benchmarks/gpu/gemma2_decode_attention.py --table "$ROWS"
