"""The batch-1 Triton GEMV (plain, with RMSNorm fused before it, with SiLU-and-mul fused after it) vs the
unfused layers (RMSNorm.forward_native, F.linear, SiluAndMul.forward_native).

Small shapes run compiled on a GPU when there is one, else under TRITON_INTERPRET=1 on CPU tensors; the
`gpu` cases use Llama-3-8B shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from braid.runtime.layers.activation import SiluAndMul
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.triton_gemv import decode_gemv_applies, gemv

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def rel_err(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out.float()).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def tensors(n, k, dtype, device, seed, rows=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(device=device, dtype=dtype)
    res = torch.randn(1, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(rows or n, k, generator=gen) / k ** 0.5).to(device=device, dtype=dtype)
    norm = RMSNorm(k, 1e-5)
    norm.weight.data = (torch.randn(k, generator=gen) * 0.3 + 1.0).to(device=device, dtype=dtype)
    return x, res, w, norm


def reference(x, res, w, norm, use_norm, use_res, silu):
    """The unfused path in float64 from the same rounded inputs, rounded where the layers round."""
    res_out = None
    if use_norm:
        if use_res:
            x, res_out = norm.forward_native(x, res)
        else:
            x, res_out = norm.forward_native(x), x
    y = F.linear(x.double(), w.double()).to(x.dtype)
    if silu:
        y = SiluAndMul().forward_native(y.double()).to(x.dtype)
    return y, res_out


@pytest.mark.parametrize("n,k", [(48, 64), (37, 200), (5, 1), (16, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_norm,use_res,silu", [(False, False, False), (True, True, False), (True, False, False),
                                                   (True, True, True), (False, False, True)])
def test_gemv_matches_unfused_layers(n, k, dtype, use_norm, use_res, silu):
    x, res, w, norm = tensors(n, k, dtype, DEVICE, n * 1000 + k, rows=2 * n if silu else n)
    want, want_res = reference(x, res, w, norm, use_norm, use_res, silu)
    got, got_res = gemv(x, w, norm_weight=norm.weight if use_norm else None, residual=res if use_res else None,
                        eps=norm.eps, silu_mul=silu)
    # bf16: the GEMV accumulates in fp32 where the reference is float64; the interpreter truncates to bf16 at
    # each of up to four rounding points where the GPU rounds to nearest
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2 if HAS_CUDA else 4e-2)
    if use_norm and use_res:
        # exact on a GPU; the interpreter truncates the bf16 sum where PyTorch rounds it (one ulp)
        exact = HAS_CUDA or dtype == torch.float32
        torch.testing.assert_close(got_res, want_res, rtol=0 if exact else 1e-2, atol=0 if exact else 1e-2)
    elif use_norm:
        assert got_res is x
    else:
        assert got_res is None


def test_gemv_rejects_bad_shapes():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv(x, torch.randn(4, 8))
    with pytest.raises(ValueError, match="2N"):
        gemv(x[:1], torch.randn(5, 8), silu_mul=True)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x[:1], torch.randn(4, 8), norm_weight=torch.ones(7))
    with pytest.raises(ValueError, match="residual"):
        gemv(x[:1], torch.randn(4, 8), norm_weight=torch.ones(8), residual=torch.ones(1, 8, dtype=torch.float64))


def test_decode_gemv_applies_only_to_batch1_half_cuda():
    w = torch.randn(4, 8, dtype=torch.bfloat16)
    assert not decode_gemv_applies(torch.randn(1, 8, dtype=torch.bfloat16), w)  # CPU tensors
    if HAS_CUDA:
        wc = w.cuda()
        assert decode_gemv_applies(torch.randn(1, 8, dtype=torch.bfloat16, device="cuda"), wc)
        assert not decode_gemv_applies(torch.randn(2, 8, dtype=torch.bfloat16, device="cuda"), wc)
        assert not decode_gemv_applies(torch.randn(1, 8, device="cuda"), wc.float())
        assert not decode_gemv_applies(torch.randn(1, 8, dtype=torch.bfloat16, device="cuda"), wc,
                                       torch.zeros(4, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,use_norm,silu", [(6144, 4096, True, False), (4096, 4096, False, False),
                                               (14336, 4096, True, True), (4096, 14336, False, False),
                                               (128256, 4096, False, False)])
def test_gpu_gemv_llama3_8b_shapes(n, k, use_norm, silu):
    x, res, w, norm = tensors(n, k, torch.bfloat16, "cuda", n + k, rows=2 * n if silu else n)
    want, want_res = reference(x, res, w, norm, use_norm, use_norm, silu)
    got, got_res = gemv(x, w, norm_weight=norm.weight if use_norm else None, residual=res if use_norm else None,
                        eps=norm.eps, silu_mul=silu)
    assert rel_err(got, want) < 1e-2
    if use_norm:
        assert torch.equal(got_res, want_res)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_pdl_chain_in_cuda_graph_matches_without_pdl():
    """A decode-shaped chain (add+RMSNorm -> GEMV -> GEMV(SiLU) -> GEMV, repeated) where every kernel reads
    the one before's output: captured and replayed with programmatic dependent launch it must give the
    bit-identical result of the same kernels launched without it."""
    from braid.runtime.layers import pdl
    from braid.runtime.layers.triton_fused import fused_add_rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(0)
    k, inter = 4096, 14336
    layers = [((torch.randn(6144, k, device="cuda", generator=gen) / k ** 0.5).bfloat16(),
               (torch.randn(2 * inter, k, device="cuda", generator=gen) / k ** 0.5).bfloat16(),
               (torch.randn(k, inter, device="cuda", generator=gen) / inter ** 0.5).bfloat16()) for _ in range(4)]
    norm_w = torch.rand(k, device="cuda", generator=gen).bfloat16() + 0.5
    x0 = torch.randn(1, k, device="cuda", generator=gen).bfloat16()

    def chain(x):
        residual = torch.zeros_like(x)
        for qkv, gate_up, down in layers:
            h, residual = fused_add_rmsnorm(x, residual, norm_w, 1e-5)
            q = gemv(h, qkv)[0]
            x = gemv(gemv(h + q[:, :k], gate_up, silu_mul=True)[0], down)[0]
        return x + residual

    saved = pdl.ENABLED
    try:
        pdl.ENABLED = False
        want = chain(x0)
        pdl.ENABLED = True
        assert pdl.enabled(x0.device) == (torch.cuda.get_device_capability() >= (9, 0))
        static_x = x0.clone()
        chain(static_x)  # compile and autotune outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
    finally:
        pdl.ENABLED = saved


def test_pdl_launch_options_only_where_the_gpu_has_it():
    from braid.runtime.layers import pdl

    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    saved = pdl.ENABLED
    try:
        pdl.ENABLED = False
        assert not pdl.enabled(torch.device("cuda", 0))
        if HAS_CUDA:
            pdl.ENABLED = True
            hopper = torch.cuda.get_device_capability() >= (9, 0)
            assert pdl.enabled(torch.device("cuda")) == hopper
            assert pdl.launch_options(torch.device("cuda")) == (
                {"USE_PDL": True, "launch_pdl": True} if hopper else {"USE_PDL": False})
    finally:
        pdl.ENABLED = saved
