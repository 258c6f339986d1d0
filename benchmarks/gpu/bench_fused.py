"""Fused layer kernels vs their PyTorch paths inside CUDA graphs on the GPU (T = 1, 8, 64, 4096).
Run on the device: python3 benchmarks/gpu/bench_fused.py"""
import torch
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.layers.activation import SiluAndMul
d, b = "cuda", torch.bfloat16
n = RMSNorm(4096).to(d); n.weight.data = torch.rand(4096, device=d, dtype=b)
r = RotaryEmbedding(128, 128, 8192, 5e5); r.build_cache(d)
a = SiluAndMul()
def tm(f, it=20):
    g = torch.cuda.CUDAGraph(); f(); torch.cuda.synchronize()
    with torch.cuda.graph(g): f()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
    for _ in range(it): g.replay()
    e.record(); e.synchronize(); return s.elapsed_time(e) * 1e3 / it
for T in (1, 8, 64, 4096):
    h = torch.randn(T, 4096, device=d, dtype=b); res = torch.randn_like(h)
    qkv = torch.randn(T, 6144, device=d, dtype=b); gu = torch.randn(T, 28672, device=d, dtype=b)
    p = torch.arange(T, device=d)
    q, k, _ = qkv.split([4096, 1024, 1024], -1)
    ops = {"add_rmsnorm": (lambda: n(h, res), lambda: n.forward_native(h, res), 4 * T * 8192),
           "rotary": (lambda: r(p, q, k), lambda: r.forward_native(p, q, k), 4 * T * 5120),
           "silu_mul": (lambda: a(gu), lambda: a.forward_native(gu), T * 3 * 28672)}
    for name, (f, nat, nbytes) in ops.items():
        L = 32
        fu = tm(lambda: [f() for _ in range(L)]) / L
        na = tm(lambda: [nat() for _ in range(L)]) / L
        print(f"T={T:5d} {name:12s} fused {fu:7.2f} us  native {na:7.2f} us  x{na / fu:5.1f}  fused {nbytes / fu / 1e6:6.2f} TB/s")
