# Gemma-2-9B decode attention alone (benchmarks/gpu/gemma2_decode_attention.py): one global layer (8,192 keys) and one
# window layer (the last 4,096 of 8,192), head_dim 256, 16/8 heads, soft-cap, bf16, batch 1 and 8; the Triton kernel
# over split counts x stage-1 configs (the runtime's choice among them), FlashInfer's decode when it imports (or was
# staged as flashinfer_vs_triton.sh describes). Prints the table last: the runtime's figure, the sweep's best, and
# the time the best would save per decode step. carry: .whl (and .gpu/fi2 on the second call of a FlashInfer staging)
#   bash benchmarks/gpu/gemma2_decode_attention.sh        (~6-8.5 min; the Triton sweep stops itself after 230-330 s)
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
ROWS="$OUT/gemma2_decode_attention.jsonl"
rm -f "$ROWS"
install_staged_flashinfer

# the Triton sweep's budget leaves FlashInfer its JIT build (the four Gemma-2 modules, side by side) and timing
SWEEP_S=330; FI=0
if python3 -c "import flashinfer" >/dev/null 2>&1; then SWEEP_S=230; FI=1
else echo "SKIP flashinfer: not importable here (stage its wheel as benchmarks/gpu/flashinfer_vs_triton.sh does)"; fi
timeout $((SWEEP_S + 60)) python3 benchmarks/gpu/gemma2_decode_attention.py --impls triton --budget-s $SWEEP_S \
  --out "$ROWS" 2>&1 | grep -v Warning > "$OUT/triton_sweep.log" \
  || echo "FAIL Triton sweep did not finish (see triton_sweep.log)"
grep -v '^{' "$OUT/triton_sweep.log" | tail -12
if [ $FI = 1 ]; then
  timeout 100 python3 benchmarks/gpu/gemma2_8k_decode.py --prebuild-flashinfer 256 2>&1 | grep -v Warning | tail -3
  timeout 100 python3 benchmarks/gpu/gemma2_decode_attention.py --impls flashinfer --out "$ROWS" 2>&1 \
    | grep -v Warning > "$OUT/flashinfer.log" || echo "FAIL FlashInfer timing did not finish in 100 s (see flashinfer.log)"
fi
python3 benchmarks/gpu/gemma2_decode_attention.py --table "$ROWS"
