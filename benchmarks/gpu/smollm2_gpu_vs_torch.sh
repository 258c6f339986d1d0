# SmolLM2 (real weights) on the GPU: tests/models/test_gpu_engine.py checks the Triton backend with CUDA graphs, PDL
# and the overlapped scheduler, padded graph replay and torch.compile against the torch backend, token for token in
# fp32, and bf16 agreement. The GGUF travels in two halves over two calls on the same warm machine (setup.sh):
#   bash benchmarks/gpu/smollm2_gpu_vs_torch.sh stage   carry .gpu/a (part_aa): keeps the first half in /tmp
#   bash benchmarks/gpu/smollm2_gpu_vs_torch.sh         carry .whl .gpu/b .gpu/tok
set -o pipefail
if [ "$1" = stage ]; then cp .gpu/a/part_aa /tmp/part_aa && echo "first half kept in /tmp"; exit; fi
source benchmarks/gpu/setup.sh
cat /tmp/part_aa .gpu/b/part_ab > /tmp/smollm2.gguf && echo "$(cat .gpu/tok/smollm2.sha256)  /tmp/smollm2.gguf" | sha256sum -c || exit 1
export BRAID_SMOLLM2_GGUF=/tmp/smollm2.gguf
timeout 300 python3 -m pytest tests/models/test_gpu_engine.py -q -s -p no:cacheprovider 2>&1 | grep -v "Warning\|DEBUG" | tail -60 | tee "$OUT/gpu_engine.log"
