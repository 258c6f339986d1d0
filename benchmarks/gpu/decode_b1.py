"""Batch-1 decode of Llama-3-8B-shaped dummy weights on the GPU: where the step's time goes, and A/B variants.

Prints (1) the GEMM floor: the step's weight GEMMs alone in one CUDA graph, cuBLAS vs braid's Triton GEMV;
(2) bench_one_batch's median decode step (128 in / 512 out) for: indexed KV writes (two copies per layer),
the fused KV store, and the fused store + Triton GEMV at batch 1; (3) the kernels of one graphed step.
Run on the device: python3 benchmarks/gpu/decode_b1.py
"""
import sys
import time

import torch
import torch.nn.functional as torch_F

from braid.runtime.bench.bench_one_batch import StaticBatchRunner, latency_test
from braid.runtime.config import ServerArgs
from braid.runtime.layers import cpu_gemm
from braid.runtime.layers.triton_gemv import gemv, supports
from braid.runtime.mem_cache import pools
from braid.runtime.model_executor.cuda_graph import CudaGraphRunner
from braid.runtime.model_executor.model_runner import ModelRunner

ROOFLINE_GB = 15.0


class GemvShim:
    """Stands in for torch.nn.functional inside cpu_gemm (every Linear and the LMHead call it; on CUDA it runs
    F.linear): batch-1 GEMMs go to the Triton GEMV."""

    def __getattr__(self, name):
        return getattr(torch_F, name)

    @staticmethod
    def linear(x, w, b=None):
        if b is None and x.is_cuda and supports(x, w):
            return gemv(x, w)
        return torch_F.linear(x, w, b)


def graph_time_us(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(iters):
            g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    return sorted(times)[2]


def main():
    args = ServerArgs(model_path="llama3-8b-dummy", load_format="dummy", model_config="benchmarks/configs/llama3-8b.json",
                      dtype="bfloat16", max_total_tokens=8192, cuda_graph_max_bs=4, log_level="warning")
    runner = ModelRunner(args)
    model = runner.model
    weights = []
    for layer in model.model.layers:
        weights += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight,
                    layer.mlp.down_proj.weight]
    weights.append(model.lm_head.weight)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in weights}
    rows = []
    for name, lin in (("cuBLAS F.linear", torch_F.linear), ("Triton gemv", lambda x, w: gemv(x, w))):
        try:
            us = graph_time_us(lambda: [lin(xs[w.shape[1]], w) for w in weights])
        except Exception as e:  # noqa: BLE001 - report and go on with the other measurements
            print(f"{name} failed: {e!r}"[:400])
            continue
        rows.append((name, us, nbytes / us / 1e6))
    print(f"GEMM floor of one step ({nbytes / 1e9:.2f} GB of weights):")
    for name, us, tbs in rows:
        print(f"  {name:18s} {us:8.1f} us  {tbs:5.2f} TB/s")

    sb = StaticBatchRunner(runner)
    variants = [("indexed KV writes", False, False), ("fused KV store", True, False),
                ("fused KV store + gemv", True, True)]
    results = []
    for name, fused, use_gemv in variants:
        pools.FUSED_KV_STORE = fused
        shim = GemvShim() if use_gemv else torch_F
        cpu_gemm.F = shim
        meds = []
        try:
            runner.cuda_graph_runner = CudaGraphRunner(runner)  # re-capture with this variant's kernels
            sb.run([[1, 2, 3]], 4)
            for rep in range(2):
                result, _ = latency_test(sb, 1, 128, 512, seed=rep)
                meds.append(result["median_decode_latency_s"])
        except Exception as e:  # noqa: BLE001
            print(f"{name} failed: {e!r}"[:400])
            continue
        med = min(meds)
        results.append((name, med))
        print(f"{name:24s} median decode step {med * 1e3:.3f} ms (runs {', '.join(f'{m * 1e3:.3f}' for m in meds)})",
              flush=True)

    best = min(results, key=lambda r: r[1])
    pools.FUSED_KV_STORE = best[0] != "indexed KV writes"
    cpu_gemm.F = GemvShim() if "gemv" in best[0] else torch_F
    runner.cuda_graph_runner = CudaGraphRunner(runner)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sb.run([list(range(1, 129))], 21)
    steps = 20
    print(f"\nkernels of a decode step ({best[0]}), per step over {steps} steps + 1 prefill:")
    evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]
    for e in evs:
        print(f"  {e.device_time_total / steps:9.1f} us  x{e.count / steps:6.1f}  {e.key[:90]}")

    print("\nvariant                   step ms  tok/s  of 285 roofline")
    for name, med in results:
        print(f"{name:24s} {med * 1e3:8.3f} {1 / med:6.1f}  {1 / med / (4.28e12 / (ROOFLINE_GB * 1e9)):6.1%}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"({time.time() - t0:.0f} s)")
    sys.exit(rc)
