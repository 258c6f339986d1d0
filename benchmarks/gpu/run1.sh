# Device call 1 (carry .whl .gpu/a .gpu/tok): Llama-3-8B-shaped bench_one_batch beside HF, then the kernel tests.
cd .gpu/src 2>/dev/null && ln -sfn ../../.whl .whl && mkdir -p .gpu && for d in a b tok; do ln -sfn ../../$d .gpu/$d; done
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
CFG=benchmarks/configs/llama3-8b.json
timeout 330 python3 -m braid.bench_one_batch --load-format dummy --model-config $CFG --model-path llama3-8b-dummy \
  --dtype bfloat16 --max-total-tokens 200000 --cuda-graph-max-bs 256 --log-level warning \
  --batch-size 1 8 32 64 128 256 --input-len 128 --output-len 512 256 --compare-hf --hf-output-len 32 \
  --result-filename $OUT/one_batch.jsonl 2>&1 | grep -v Warning | tee $OUT/one_batch.log
timeout 150 python3 -m pytest tests/kernels -q -m gpu -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/kernels.log
timeout 45 python3 benchmarks/gpu/bench_fused.py 2>&1 | tail -12 | tee $OUT/fused_bench.log
