"""The tensor-core kernel for 2..16 rows of x with bf16/fp16 weights (small_batch_gemm.py) against the unfused layers
(F.linear, then SiLU- or GELU-tanh-and-mul), split over K or not, and the Linear's routing to it.

Small shapes (rows, K not multiples of the tile) run compiled on a GPU when there is one, else under
TRITON_INTERPRET=1 on CPU tensors (tests/kernels/conftest.py); the `gpu` cases take Gemma-2-9B and Llama-3-8B shapes
with every tile the benchmark sweeps, inside a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from braid.runtime.config import ServerArgs
from braid.runtime.layers.activation import GeluAndMul, SiluAndMul
from braid.runtime.layers.kernel_switches import kernel_switches_applied
from braid.runtime.layers.small_batch_gemm import (CANDIDATE_TILES, DEFAULT_TILE, TcTile, small_batch_gemm,
                                                   small_batch_gemm_applies, split_k)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
INTERPRETER_TILE = TcTile(64, 32, 4, 1)
# fp32 sums of bf16 products against float64 from the same inputs, one rounding of the output (the interpreter
# truncates to bf16 where the GPU rounds to nearest; GELU's result is rounded once more before the product)
TOLERANCE = 1e-2 if HAS_CUDA else 3e-2


def rel_err(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out.float()).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def tensors(m, rows, k, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(rows, k, generator=gen) / k ** 0.5).to(device=device, dtype=dtype)
    return x, w


def reference(x, w, activation):
    """The unfused path in float64 from the same rounded inputs, rounded where the layers round."""
    y = F.linear(x.double(), w.double()).to(x.dtype)
    if activation == "silu":
        y = SiluAndMul().forward_native(y.double()).to(x.dtype)
    elif activation == "gelu":
        gate, up = y.double().chunk(2, dim=-1)
        y = (F.gelu(gate, approximate="tanh").to(x.dtype).double() * up).to(x.dtype)
    return y


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(64, 64), (70, 200), (130, 96)])
@pytest.mark.parametrize("activation", ["", "silu", "gelu"])
def test_small_batch_gemm_matches_unfused_layers(m, n, k, activation):
    x, w = tensors(m, 2 * n if activation else n, k, torch.bfloat16, DEVICE, m * 7 + n * 1000 + k)
    tile = None if HAS_CUDA else INTERPRETER_TILE
    assert rel_err(small_batch_gemm(x, w, activation=activation, tile=tile), reference(x, w, activation)) < TOLERANCE


@pytest.mark.parametrize("split", [2, 4, 8])
def test_split_k_sums_in_order_and_resets_its_counters(split):
    """Split over K, the last program of each row tile adds the partial sums and resets its counter: a second call
    with another x gives its own answer, and every call the same bits (the splits are added in order, whichever
    program arrives last); more splits than chunks (8 x 32 > 200) leave some empty."""
    x, w = tensors(6, 70, 200, torch.bfloat16, DEVICE, 11)
    x2 = x.flip(-1).contiguous()
    tile = TcTile(64, 32, 4, 1, split_k=split)
    assert split_k(tile, 70, 200, torch.device(DEVICE)) == split
    first = small_batch_gemm(x, w, tile=tile)
    assert rel_err(first, reference(x, w, "")) < TOLERANCE
    assert rel_err(small_batch_gemm(x2, w, tile=tile), reference(x2, w, "")) < TOLERANCE
    assert torch.equal(small_batch_gemm(x, w, tile=tile), first)


def test_small_batch_gemm_refuses_what_it_cannot_run():
    x, w = tensors(4, 64, 64, torch.bfloat16, "cpu", 1)
    with pytest.raises(ValueError, match="small_batch_gemm needs"):
        small_batch_gemm(torch.randn(17, 64, dtype=torch.bfloat16), w)  # more rows than the operand's 16 columns
    with pytest.raises(ValueError, match="small_batch_gemm needs"):
        small_batch_gemm(x, w.float())  # dtypes differ
    with pytest.raises(ValueError, match="small_batch_gemm needs"):
        small_batch_gemm(x, w[:63], activation="silu")  # a gated weight has 2N rows
    with pytest.raises(ValueError, match="activation"):
        small_batch_gemm(x, w, activation="relu")
    with pytest.raises(ValueError, match="block_n >= 64"):
        TcTile(32, 64)


def test_applies_only_to_measured_shapes_of_2_to_16_half_rows_on_cuda(monkeypatch):
    from braid.runtime.layers import small_batch_gemm as module

    w = torch.randn(64, 32, dtype=torch.bfloat16)
    assert not small_batch_gemm_applies(torch.randn(4, 32, dtype=torch.bfloat16), w)  # CPU tensors
    if HAS_CUDA:
        wc = w.cuda()
        x = torch.randn(16, 32, dtype=torch.bfloat16, device="cuda")
        assert not small_batch_gemm_applies(x, wc)  # no tile measured for the shape: cuBLAS
        monkeypatch.setattr(module, "MEASURED_TILES", {torch.cuda.get_device_name(): {(64, 32, ""): (DEFAULT_TILE, 8)}})
        assert small_batch_gemm_applies(x[:2], wc) and small_batch_gemm_applies(x[:8], wc)
        assert not small_batch_gemm_applies(x[:9], wc)  # measured faster up to 8 rows only: cuBLAS above
        monkeypatch.setattr(module, "MEASURED_TILES", {torch.cuda.get_device_name(): {(64, 32, ""): (DEFAULT_TILE, 16)}})
        assert small_batch_gemm_applies(x, wc)
        assert not small_batch_gemm_applies(x, wc, activation="silu")  # another measured key
        assert not small_batch_gemm_applies(x[:1], wc)  # the batch-1 GEMV's
        assert not small_batch_gemm_applies(torch.cat([x, x[:1]]), wc)
        assert not small_batch_gemm_applies(x.float(), wc.float())
        assert not small_batch_gemm_applies(x, wc, torch.zeros(64, dtype=torch.bfloat16, device="cuda"))
        with kernel_switches_applied(ServerArgs(disable_decode_gemv=True)):
            assert not small_batch_gemm_applies(x, wc)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "silu", "gelu"])
def test_gpu_linear_routes_small_batches_here(monkeypatch, act):
    """A bf16 Linear at 8 rows whose shape has a measured tile calls the kernel with its gated activation fused (the
    same result as cuBLAS and the unfused activation within rounding); ServerArgs.disable_decode_gemv sends it to
    cuBLAS."""
    from braid.runtime.layers import small_batch_gemm as module
    from braid.runtime.layers.linear import Linear

    calls = []
    real = module.small_batch_gemm
    monkeypatch.setattr(module, "small_batch_gemm", lambda *a, **kw: calls.append(kw["activation"]) or real(*a, **kw))
    layer_act = {"silu": SiluAndMul(), "gelu": GeluAndMul(approximate="tanh"), None: None}[act]
    monkeypatch.setattr(module, "MEASURED_TILES", {torch.cuda.get_device_name(): {(256, 256, act or ""): (DEFAULT_TILE, 16)}})
    lin = Linear(256, 256).to(device="cuda", dtype=torch.bfloat16)
    lin.weight.data.normal_(std=256 ** -0.5)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    with kernel_switches_applied(ServerArgs()):
        on = lin(x, layer_act) if act else lin(x)
    assert calls == [act or ""]
    with kernel_switches_applied(ServerArgs(disable_decode_gemv=True)):
        off = lin(x, layer_act) if act else lin(x)
    assert calls == [act or ""]
    assert rel_err(on, off) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 3584, ""), (3584, 4096, ""), (28672, 3584, "gelu"), (3584, 14336, ""),
                                   (6144, 4096, ""), (28672, 4096, "silu")])
def test_gpu_real_shapes_in_a_cuda_graph(shape):
    """Gemma-2-9B and Llama-3-8B shapes, captured and replayed in a CUDA graph (the split-K counters must be back at
    zero between replays for the second to match): every candidate tile at 8 rows, the default at 2 and 16."""
    from triton.runtime.errors import OutOfResources

    rows, k, activation = shape
    for m, tiles in ((8, CANDIDATE_TILES), (2, (DEFAULT_TILE,)), (16, (DEFAULT_TILE,))):
        x, w = tensors(m, rows, k, torch.bfloat16, "cuda", rows + k + m)
        want = reference(x, w, activation)
        for tile in tiles:
            try:
                first = small_batch_gemm(x, w, activation=activation, tile=tile)
            except OutOfResources:  # a candidate over this GPU's shared memory (the sweep skips it too)
                assert tile != DEFAULT_TILE
                continue
            assert rel_err(first, want) < 1e-2, (m, tile)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = small_batch_gemm(x, w, activation=activation, tile=tile)
            for _ in range(2):
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, first), (m, tile)


def _sweep_script():
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
    sys.path.insert(0, str(folder))  # the script imports its neighbours
    try:
        spec = importlib.util.spec_from_file_location("small_batch_gemm_sweep", folder / "small_batch_gemm.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(folder))
    return script


def test_sweep_routes_a_shape_only_up_to_the_rows_where_its_tile_beat_cublas():
    """benchmarks/gpu/small_batch_gemm.py's MEASURED_TILES rule: the best tile at 8 rows, kept up to the largest row
    count from 2 on at which that tile beat cuBLAS by more than 2%; a shape it loses at 2 or 8 rows stays on cuBLAS."""
    fast, slow = TcTile(64, 256, 4, 2), DEFAULT_TILE

    def rows_of(key, m, cublas_us, fast_us, slow_us):
        base = {"rows": key[0], "k": key[1], "act": key[2], "m": m}
        return [{**base, "kernel": "cuBLAS", "tile": "-", "us": cublas_us},
                {**base, "kernel": "tc", "tile": repr(fast), "tile_args": dataclasses.astuple(fast), "us": fast_us},
                {**base, "kernel": "tc", "tile": repr(slow), "tile_args": dataclasses.astuple(slow), "us": slow_us}]

    wins_to_8, wins_all, loses_at_2, loses_at_8 = (8192, 3584, ""), (3584, 4096, ""), (28672, 3584, "gelu"), (1, 2, "")
    sweep = (rows_of(wins_to_8, 2, 10, 9, 11) + rows_of(wins_to_8, 8, 10, 9, 9.5) + rows_of(wins_to_8, 16, 10, 10, 11)
             + rows_of(wins_all, 2, 10, 9, 11) + rows_of(wins_all, 8, 10, 9, 11) + rows_of(wins_all, 16, 10, 9.7, 11)
             + rows_of(loses_at_2, 2, 10, 10, 10) + rows_of(loses_at_2, 8, 10, 8, 9)
             + rows_of(loses_at_8, 2, 10, 8, 9) + rows_of(loses_at_8, 8, 10, 9.9, 10.5))
    assert _sweep_script().winning_tiles(sweep) == {wins_to_8: (fast, 8), wins_all: (fast, 16)}
