# The GPU kernel tests (Triton attention, GEMV, fused norm/rotary/activation/KV-store kernels, PDL chains in CUDA
# graphs, each against a PyTorch reference), then the fused layer kernels timed against the PyTorch path in CUDA
# graphs (benchmarks/gpu/bench_fused.py). carry: .whl
#   bash benchmarks/gpu/kernels_gpu.sh
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout 200 python3 -m pytest tests/kernels -q -m gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/kernels.log"
timeout 60 python3 benchmarks/gpu/bench_fused.py 2>&1 | tail -12 | tee "$OUT/fused_bench.log"
