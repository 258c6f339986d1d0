# tp 1 through the distributed (NCCL) code path on one H200 (issue 20; multi-GPU machines are not lent), one device
# call of at most ~8 minutes. carry: .whl .gpu/tok
#   bash benchmarks/gpu/tp1_distributed_path.sh
# 1. the gpu-marked test: a tiny random Llama (fp32) through a world of one (--dist-init-addr at --tp-size 1: every
#    all-reduce, the vocab-parallel embedding and LM head paths, the sampled-id broadcast, the leader's gloo
#    broadcasts) decodes what the plain path does, eager and with CUDA graphs;
# 2. Llama-3-8B-shaped dummy weights (bf16): greedy tokens of 4 prompts x 48 tokens on the plain and the distributed
#    path (CUDA graphs, then eager) must be identical; decode tok/s at batch 1 (256 tokens) and 32 (128 tokens) per path;
# then the table and PASS/FAIL lines.
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
started=$(date +%s)
step() { echo; echo "=== $1 (at $(( $(date +%s) - started )) s)"; }

step "gpu test: NCCL world of one == plain path (tiny Llama, eager and CUDA graphs)"
timeout 150 python3 -m pytest tests/distributed/test_distributed_path_gpu.py -q -m gpu -p no:cacheprovider 2>&1 \
  | tail -8 | tee "$OUT/tests.log"
grep -qE "[0-9]+ passed" "$OUT/tests.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/tests.log" \
  && echo "PASS gpu test" || echo "FAIL gpu test (see above)"

step "Llama-3-8B-shaped dummy: plain vs distributed path"
timeout 300 python3 benchmarks/gpu/tp1_distributed_path.py "$OUT" 2>&1 | grep -v Warning | tail -16 \
  | tee "$OUT/summary.txt"
echo "done in $(( $(date +%s) - started )) s"
