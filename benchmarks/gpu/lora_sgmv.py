"""LoRA delta at decode shapes on one GPU: Triton SGMV kernels vs the torch reference vs the base matmul.

The row-block Triton kernels (runtime/lora/sgmv_kernels.py) and the per-row ones (runtime/lora/bgmv_kernels.py,
which lora_shrink / lora_expand launch up to ops.BGMV_MAX_ROWS rows) against the torch reference (one matmul per
adapter present, host groups precomputed as the manager does), the one-launch candidate of lora_fused.py (this
folder; up to FUSED_MAX_ROWS rows), and all against torch.matmul of the base linear of the same shape.

  python3 benchmarks/gpu/lora_sgmv.py [--rows 1 4 16 64 256] [--adapters 8 64] [--rank 16] [--linears qkv gate_up down]

Llama-3-8B linears, bf16: qkv (in 4096, out 4096 + 1024 + 1024), gate_up (in 4096, out 2 x 14336), down (in 14336,
out 4096). Every row is on an adapter drawn at random from --adapters. Each op runs over several copies of its
weights (one per "layer", enough that L2 holds none between uses) inside one CUDA graph, so times are per layer
without launch overhead; the sort of idx (once per forward pass) is outside them. GB/s counts the unique bytes a
layer must move: the A and B of the adapters present, x read, y read and written (the base: W, x, y written), and is
set against the card's copy rate measured first. The last column is the LoRA delta's time over the base matmul's.
"""

from __future__ import annotations

import argparse
import math
import sys

from braid.runtime.lora.bgmv_kernels import bgmv_expand, bgmv_shrink
from lora_fused import lora_fused  # benchmarks/gpu, this script's folder
from sweep_rows import copy_bandwidth

LINEARS = {"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [14336, 14336]), "down": (14336, [4096])}
L2_BYTES = 50 * 2**20
FUSED_MAX_ROWS = 32  # the one-launch candidate recomputes h per column block: timed on decode-sized batches only


def _graph_time_us(fn, layers: int, iters: int) -> float:
    """Per-call time of fn(layer) for layer in range(layers), all captured in one CUDA graph."""
    import torch

    for layer in range(layers):  # compile and warm up outside the capture
        fn(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * layers)


def _layers_for(bytes_per_layer: int) -> int:
    return max(2, min(32, math.ceil(4 * L2_BYTES / max(bytes_per_layer, 1))))


def _lora_times(name: str, rows: int, adapters: int, rank: int, iters: int, gen) -> tuple[float, float, float, int]:
    """-> (sgmv us, torch reference us, adapters present) per layer."""
    import torch

    from braid.runtime.lora.ops import adapter_groups, expand_reference, shrink_reference
    from braid.runtime.lora.sgmv_kernels import row_order, sgmv_expand, sgmv_shrink

    d_in, outs = LINEARS[name]
    dev, dt = "cuda", torch.bfloat16
    idx = torch.randint(0, adapters, (rows,), device=dev, generator=gen)
    groups = adapter_groups(idx)  # the host's groups, once per batch (a sync, outside the timed region)
    layers = _layers_for(adapters * rank * 2 * (len(outs) * d_in + sum(outs)))
    a = [torch.randn(adapters, len(outs) * rank, d_in, device=dev, dtype=dt, generator=gen) * 0.02
         for _ in range(layers)]
    b = [[torch.randn(adapters, o, rank, device=dev, dtype=dt, generator=gen) * 0.02 for o in outs]
         for _ in range(layers)]
    scale = torch.full((adapters,), 2.0, device=dev, dtype=dt)
    x = torch.randn(rows, d_in, device=dev, dtype=dt, generator=gen)
    y = torch.randn(rows, sum(outs), device=dev, dtype=dt, generator=gen)

    want = expand_reference(y.clone(), shrink_reference(x, a[0], idx, groups), b[0], scale, idx, groups)
    order = row_order(idx)
    got = sgmv_expand(y.clone(), sgmv_shrink(x, a[0], idx, order), b[0], scale, idx, order)
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    got = bgmv_expand(y.clone(), bgmv_shrink(x, a[0], idx), b[0], scale, idx)
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    if rows <= FUSED_MAX_ROWS:
        got = lora_fused(y.clone(), x, a[0], b[0], scale, idx)
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)

    sgmv_us = _graph_time_us(lambda l: sgmv_expand(y, sgmv_shrink(x, a[l], idx, order), b[l], scale, idx, order),
                             layers, iters)
    torch_us = _graph_time_us(lambda l: expand_reference(y, shrink_reference(x, a[l], idx, groups), b[l], scale, idx,
                                                         groups), layers, iters)
    bgmv_us = _graph_time_us(lambda l: bgmv_expand(y, bgmv_shrink(x, a[l], idx), b[l], scale, idx), layers, iters)
    fused_us = (_graph_time_us(lambda l: lora_fused(y, x, a[l], b[l], scale, idx), layers, iters)
                if rows <= FUSED_MAX_ROWS else float("nan"))
    return sgmv_us, torch_us, bgmv_us, fused_us, len(groups)


def _base_time(name: str, rows: int, iters: int, gen) -> float:
    import torch

    d_in, outs = LINEARS[name]
    x = torch.randn(rows, d_in, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = [torch.randn(sum(outs), d_in, device="cuda", dtype=torch.bfloat16, generator=gen)
         for _ in range(_layers_for(sum(outs) * d_in * 2))]
    return _graph_time_us(lambda l: torch.matmul(x, w[l].t()), len(w), iters)


def bench_case(name: str, rows: int, adapters: int, rank: int, iters: int) -> dict:
    import torch

    d_in, outs = LINEARS[name]
    d_out, esize = sum(outs), 2
    gen = torch.Generator(device="cuda").manual_seed(rows * 1000 + adapters)
    sgmv_us, torch_us, bgmv_us, fused_us, present = _lora_times(name, rows, adapters, rank, iters, gen)
    base_us = _base_time(name, rows, iters, gen)
    torch.cuda.empty_cache()
    moved = present * rank * esize * (len(outs) * d_in + d_out) + rows * esize * (d_in + 2 * d_out)
    base_moved = esize * (d_out * d_in + rows * (d_in + d_out))
    return dict(linear=name, rows=rows, adapters=adapters, present=present, sgmv_us=sgmv_us, torch_us=torch_us, bgmv_us=bgmv_us,
                fused_us=fused_us, sgmv_gbs=moved / sgmv_us / 1e3, base_us=base_us, base_gbs=base_moved / base_us / 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="decode batch sizes T")
    p.add_argument("--adapters", type=int, nargs="+", default=[8, 64], help="adapters rows draw from")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--linears", nargs="+", default=list(LINEARS), choices=list(LINEARS))
    p.add_argument("--iters", type=int, default=50, help="graph replays per timing")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("lora_sgmv: needs a CUDA device", file=sys.stderr)
        return 1
    copy_gbs = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, rank {args.rank}, bf16, "
          f"copy rate {copy_gbs:.0f} GB/s", flush=True)
    results = []
    for name in args.linears:
        for adapters in args.adapters:
            for rows in args.rows:
                r = bench_case(name, rows, adapters, args.rank, args.iters)
                results.append(r)
                print(f"  {name} T={rows} adapters={adapters}: sgmv {r['sgmv_us']:.1f} us, torch {r['torch_us']:.1f}"
                      f" us, bgmv {r['bgmv_us']:.1f} us, fused {r['fused_us']:.1f} us, base {r['base_us']:.1f} us",
                      flush=True)
    head = (f"{'linear':<8} {'T':>4} {'adap':>4} {'used':>4} {'sgmv us':>8} {'torch us':>9} {'torch/sgmv':>10} "
            f"{'sgmv GB/s':>9} {'of copy':>7} {'base us':>8} {'base GB/s':>9} {'sgmv/base':>9} {'bgmv us':>8} "
            f"{'bgmv/base':>9} {'fused us':>8} {'fused/base':>10}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['linear']:<8} {r['rows']:>4} {r['adapters']:>4} {r['present']:>4} {r['sgmv_us']:>8.1f} "
              f"{r['torch_us']:>9.1f} {r['torch_us'] / r['sgmv_us']:>10.2f} {r['sgmv_gbs']:>9.0f} "
              f"{r['sgmv_gbs'] / copy_gbs:>7.0%} "
              f"{r['base_us']:>8.1f} {r['base_gbs']:>9.0f} {r['sgmv_us'] / r['base_us']:>9.1%} {r['bgmv_us']:>8.1f} "
              f"{r['bgmv_us'] / r['base_us']:>9.1%} {r['fused_us']:>8.1f} {r['fused_us'] / r['base_us']:>10.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
