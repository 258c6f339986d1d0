# The batch-1 fp8 GEMV variants (issue 19) on the H200, one device call of at most ~6 minutes (a 340 s budget: each
# step gets what is left, capped). carry: .whl
#   bash benchmarks/gpu/fp8_gemv_variants.sh
# 1. the gpu tests of the variants (every runtime candidate at the 4 Llama-3-8B shapes within its error bound, all
#    254 e4m3 values through the f16 dequantization, CUDA-graph replays); they also fill Triton's cache;
# 2. bench_one_batch --quantization fp8, batch 1, 128 in / 512 out (the runtime autotunes over the candidates; only
#    batch 1's CUDA graph is captured, which saves the other sizes' kernels and captures, not batch 1's time);
# 3. the sweep (what time is left): per shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096 + SiLU-mul,
#    down 4096x14336) every variant x config: max error vs the dequantized fp32 matmul, TB/s of weight bytes with 32 layers in a CUDA
#    graph; beside them the old fp32-upcast kernel, fp8_gemv's own autotuned pick and the bf16 GEMV;
# then the table, the winners as rows to paste into fp8_gemv_candidates, PASS/FAIL lines (error bounds, >= 450 tok/s).
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), \
'capability', torch.cuda.get_device_capability())"
started=$(date +%s)
BUDGET_S=340
step() { echo; echo "=== $1 (at $(( $(date +%s) - started )) s)"; }
cap() { local left=$(( BUDGET_S - ($(date +%s) - started) )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }

step "gpu tests: fp8 GEMV variants"
timeout "$(cap 100)" python3 -m pytest tests/kernels/test_fp8_gemv_variants.py -q -m gpu -p no:cacheprovider 2>&1 \
  | tail -15 | tee "$OUT/tests.log"
grep -qE "[0-9]+ passed" "$OUT/tests.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/tests.log" \
  && echo "PASS fp8 GEMV variant gpu tests" || echo "FAIL fp8 GEMV variant gpu tests (see above)"

step "bench_one_batch --quantization fp8, batch 1 (fp8_gemv autotunes over its candidates)"
timeout "$(cap 130)" python3 -m braid.bench_one_batch --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
  --model-path llama3-8b-dummy --dtype bfloat16 --quantization fp8 --batch-size 1 --input-len 128 --output-len 512 \
  --cuda-graph-max-bs 1 --log-level info --result-filename "$OUT/one_batch.jsonl" > "$OUT/one_batch.log" 2>&1
grep -E "fp8 GEMV \(" "$OUT/one_batch.log" | cut -c1-220
grep -v Warning "$OUT/one_batch.log" | tail -6

step "sweep: variants x configs per Llama-3-8B shape"
timeout "$(cap 130)" python3 benchmarks/gpu/fp8_gemv_variants.py sweep "$OUT/sweep.jsonl" 110 2>&1 | grep -v Warning \
  > "$OUT/sweep.log"
tail -4 "$OUT/sweep.log"

step "summary"
python3 benchmarks/gpu/fp8_gemv_variants.py summary "$OUT" 2>&1 | tee "$OUT/summary.txt"
echo "done in $(( $(date +%s) - started )) s"
