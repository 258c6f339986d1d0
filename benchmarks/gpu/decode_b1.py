"""Batch-1 decode of Llama-3-8B-shaped dummy weights on the GPU: where the step's time goes, and A/B variants.

Prints (1) the GEMM floor: the step's weight GEMMs alone in one CUDA graph, cuBLAS vs braid's Triton GEMV
(autotuned, with and without programmatic dependent launch; with --sweep also the best of a config sweep per
shape); (2) bench_one_batch's median decode step (128 in / 512 out) for: cuBLAS (--disable-decode-gemv
--disable-pdl), the Triton GEMV with SiLU-and-mul fused (--disable-pdl), and that with PDL on the decode
kernels (the default); (3) the kernels of one graphed step of the fastest.
Run on the device: python3 benchmarks/gpu/decode_b1.py [--sweep]
"""
import sys
import time

import torch
import torch.nn.functional as torch_F

from braid.runtime.bench.bench_one_batch import StaticBatchRunner, latency_test
from braid.runtime.config import ServerArgs
from braid.runtime.layers.gemv import gemv
from braid.runtime.layers.embedding import LMHead
from braid.runtime.layers.kernel_switches import kernel_switches_applied
from braid.runtime.layers.linear import Linear
from braid.runtime.model_executor.cuda_graph import CudaGraphRunner
from braid.runtime.model_executor.model_runner import ModelRunner
from sweep_rows import H200_COPY_BYTES_PER_S  # benchmarks/gpu, this script's folder

ROOFLINE_GB = 15.0
SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
         for bn in (2, 4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8) for st in (1, 3)
         if bn * bk <= 16384]


def graph_time_us(fn, iters=50, reps=5):
    """fn's calls captured in one CUDA graph: the median over `reps` timings of `iters` replays, in us per replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(iters):
            g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def main():
    args = ServerArgs(model_path="llama3-8b-dummy", load_format="dummy", model_config="benchmarks/configs/llama3-8b.json",
                      dtype="bfloat16", max_total_tokens=8192, cuda_graph_max_bs=4, log_level="warning")
    runner = ModelRunner(args)
    model = runner.model
    by_shape = {}  # every layer's qkv, o, gate_up, down, then the LM head
    for module in model.modules():
        if isinstance(module, (Linear, LMHead)):
            by_shape.setdefault(tuple(module.weight.shape), []).append(module.weight)
    weights = [w for ws in by_shape.values() for w in ws]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in weights}
    rows = []
    no_pdl, with_pdl = args.replace(disable_pdl=True), args.replace(disable_pdl=False)
    for name, lin, switches in (("cuBLAS F.linear", torch_F.linear, no_pdl), ("Triton gemv", gemv, no_pdl),
                                ("Triton gemv + PDL", gemv, with_pdl)):
        with kernel_switches_applied(switches):
            us = graph_time_us(lambda: [lin(xs[w.shape[1]], w) for w in weights])
        rows.append((name, us, nbytes / us / 1e6))
    # per shape: cuBLAS, autotuned gemv, the sweep's best
    print("per shape (all layers' weights of that shape in one graph):")
    best_total = 0.0
    for shape, ws in by_shape.items():
        x = xs[shape[1]]
        b = sum(w.numel() * 2 for w in ws)
        cub = graph_time_us(lambda: [torch_F.linear(x, w) for w in ws])
        best = (float("inf"), None)
        with kernel_switches_applied(no_pdl):
            auto = graph_time_us(lambda: [gemv(x, w) for w in ws])
            for cfg in SWEEP if "--sweep" in sys.argv else []:
                try:
                    us = graph_time_us(lambda: [gemv(x, w, config=cfg) for w in ws], iters=10)
                except Exception as e:  # noqa: BLE001 - a config that does not fit: skip it
                    print(f"  {shape} {cfg} failed: {e!r}"[:200])
                    continue
                best = min(best, (us, cfg), key=lambda t: t[0])
        with kernel_switches_applied(with_pdl):
            auto_pdl = graph_time_us(lambda: [gemv(x, w) for w in ws])
        best_total += min(best[0], auto, cub, auto_pdl)
        swept = f"  sweep best {b / best[0] / 1e6:5.2f} TB/s {best[1]}" if best[1] is not None else ""
        print(f"  {str(shape):16s} cuBLAS {b / cub / 1e6:5.2f} TB/s  gemv(auto) {b / auto / 1e6:5.2f}  "
              f"+PDL {b / auto_pdl / 1e6:5.2f} TB/s{swept}", flush=True)
    rows.append(("best of each shape", best_total, nbytes / best_total / 1e6))
    print(f"GEMM floor of one step ({nbytes / 1e9:.2f} GB of weights):")
    for name, us, tbs in rows:
        print(f"  {name:18s} {us:8.1f} us  {tbs:5.2f} TB/s")

    sb = StaticBatchRunner(runner)
    variants = {"cuBLAS": args.replace(disable_decode_gemv=True, disable_pdl=True),
                "Triton GEMV (SiLU fused)": args.replace(disable_pdl=True),
                "+ PDL": args}
    results = []
    for name, switches in variants.items():
        meds = []
        try:
            with kernel_switches_applied(switches):
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
        print(f"{name:34s} median decode step {med * 1e3:.3f} ms (runs {', '.join(f'{m * 1e3:.3f}' for m in meds)})",
              flush=True)

    best = min(results, key=lambda r: r[1])
    from torch.profiler import ProfilerActivity, profile

    with kernel_switches_applied(variants[best[0]]):
        runner.cuda_graph_runner = CudaGraphRunner(runner)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sb.run([list(range(1, 129))], 21)
    steps = 20
    print(f"\nkernels of a decode step ({best[0]}), per step over {steps} steps + 1 prefill:")
    evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]
    for e in evs:
        print(f"  {e.device_time_total / steps:9.1f} us  x{e.count / steps:6.1f}  {e.key[:90]}")

    print("\nvariant                      step ms  tok/s  of 285 roofline")
    for name, med in results:
        print(f"{name:34s} {med * 1e3:8.3f} {1 / med:6.1f}  {1 / med / (H200_COPY_BYTES_PER_S / (ROOFLINE_GB * 1e9)):6.1%}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"({time.time() - t0:.0f} s)")
    sys.exit(rc)
