# LLaVA-OneVision-Qwen2-7B-shaped dummy bf16 (benchmarks/configs/llava-onevision-qwen2-7b.json) on the H200:
#   1. the LLaVA-OneVision GPU parity test (tests/models/test_llava_onevision_parity.py -m gpu: tiny random config,
#      Triton fp32 + CUDA graphs vs HF: an anyres image with a video, then two images)
#   2. multi-image workload: 200 prompts x 2 random 640x480 JPEG images (730 tokens each) + ~32 text tokens, 128 new
#      tokens, all given to braid's in-process Engine at once (JPEG decoding and pixel processing inside its time);
#      HF transformers LlavaOnevisionForConditionalGeneration.generate (sdpa, bf16, same shapes, same input ids and
#      pixels, preprocessing not timed) on a static batch of 16 of them
#   3. video workload: 64 prompts x one 16-frame video (16 * 196 + 1 tokens), 128 new tokens; HF batch 8
#   4. per workload: vision tower + projector + packing time for one request's media alone, and its share of one
#      request's latency run alone; then the table and PASS/FAIL lines (braid >= 5x HF output tok/s; every braid
#      request produced 128 tokens)
# carry: .whl .gpu/tok (SmolLM2's tokenizer folder, as setup.sh describes; the prompts' text only)
#   bash benchmarks/gpu/llava_ov_multimodal.sh        (~5-8 min; each step is time-boxed)
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
RESULT="$OUT/llava_ov.jsonl"
rm -f "$RESULT"
[ -d .gpu/tok ] || echo "FAIL .gpu/tok missing: carry SmolLM2's tokenizer folder (see benchmarks/gpu/setup.sh)"
python3 -c "import PIL" 2>/dev/null || echo "FAIL pillow is not importable here"

timeout 120 python3 -m pytest tests/models/test_llava_onevision_parity.py -q -m gpu -p no:cacheprovider 2>&1 | tail -6 \
  | tee "$OUT/gpu_tests.log"
grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q "failed\|error" "$OUT/gpu_tests.log" \
  && echo "PASS LLaVA-OneVision GPU parity test" || echo "FAIL LLaVA-OneVision GPU parity test (see gpu_tests.log)"

timeout 200 python3 benchmarks/gpu/llava_ov_multimodal.py --workload images --num-prompts 200 --hf-batch 16 \
  --output-len 128 --out "$RESULT" 2>&1 | grep -v Warning | tee "$OUT/run_images.log" | tail -4 \
  || echo "FAIL multi-image run did not finish (see run_images.log)"
timeout 200 python3 benchmarks/gpu/llava_ov_multimodal.py --workload video --num-prompts 64 --hf-batch 8 \
  --output-len 128 --out "$RESULT" 2>&1 | grep -v Warning | tee "$OUT/run_video.log" | tail -4 \
  || echo "FAIL video run did not finish (see run_video.log)"

echo "== LLaVA-OneVision-Qwen2-7B-shaped dummy bf16, braid Engine vs HF generate (output tokens/s) =="
python3 benchmarks/gpu/llava_ov_multimodal.py --table "$RESULT"
