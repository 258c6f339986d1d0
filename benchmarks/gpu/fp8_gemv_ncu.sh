# The batch-1 fp8 GEMVs of a Llama-3-8B layer under Nsight Compute (Firecracker machines, e.g. the H100 kind, where
# ncu reads the hardware counters): each shape's weight launched alone with the runtime's config (gate_up + SiLU,
# qkv, down), DRAM throughput, occupancy and warp issue state per launch. carry: .whl
#   bash benchmarks/gpu/fp8_gemv_ncu.sh
source benchmarks/gpu/setup.sh
nvidia-smi -L
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 400 "$NCU" --clock-control none -k "regex:_fp8_gemv_f16_kernel" --launch-count 6 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section LaunchStats --section SchedulerStats \
  python3 - > "$OUT/ncu.txt" 2>&1 <<'PY'
import torch

from braid.runtime.layers.quantization.fp8_gemv import fp8_gemv
from braid.runtime.layers.quantization.fp8_quantize import quantize_weight_per_channel

torch.manual_seed(0)
for n, k, silu in ((28672, 4096, True), (6144, 4096, False), (4096, 14336, False)):
    w, ws = quantize_weight_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        fp8_gemv(x, w, ws, silu_mul=silu)
    torch.cuda.synchronize()
PY
grep -E "_kernel \(|Duration|DRAM Throughput|Memory Throughput  .*byte|Registers Per|Theoretical Occupancy|Achieved Occupancy|Warp Cycles Per Issued|No Eligible|Eligible Warps" "$OUT/ncu.txt"
