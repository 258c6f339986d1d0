"""FP8 kernels of the fp8 LinearMethod: per-token activation quantization (Triton vs torch), torch._scaled_mm
against the matmul of the dequantized operands, and the batch-1 GEMV on e4m3 weights with row scales (plain and
with SiLU-and-mul fused). Small shapes run under TRITON_INTERPRET=1 on CPU tensors (tests/kernels/conftest.py);
the `gpu` cases use Llama-3-8B shapes, row-wise and tensor-wise _scaled_mm, and a CUDA graph of an fp8 Linear.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from braid.runtime.layers.activation import SiluAndMul
from braid.runtime.layers.gemv import gemv
from braid.runtime.layers.quantization.fp8_gemv import SMALL_BATCH_TC_CONFIG, fp8_gemv, fp8_gemv_error_excess
from braid.runtime.layers.quantization.fp8_quantize import (FP8_DTYPE, FP8_MAX, quantize_rows_reference,
                                                            quantize_rows_triton, quantize_weight_per_channel,
                                                            scaled_mm)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
HAS_FP8_GPU = HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)


def assert_same_fp8(q, q_ref):
    """Equal fp8 values on a GPU (hardware conversion). Triton's interpreter emulates fp32 -> e4m3 inexactly: some
    values land one e4m3 step off (352 for 320), and a value just below a power of two may lose its carry
    (124.3 -> 64 instead of 128); so there only: a few values, each at most one step or that carry off."""
    q, q_ref = q.float().cpu(), q_ref.float().cpu()
    differ = q != q_ref
    if DEVICE == "cuda":
        assert not differ.any(), (q[differ], q_ref[differ])
        return
    one_step = (q - q_ref).abs() <= q_ref.abs() * 2 ** -3 + 2 ** -9
    carry_dropped = (q_ref.abs().log2() == q_ref.abs().log2().round()) & (q * 2 == q_ref)
    assert (one_step | carry_dropped).all(), (q[differ], q_ref[differ])
    assert differ.float().mean() < 0.1


def rel_err(out, ref):
    assert torch.isfinite(out.float()).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _randn(*shape, seed, scale=1.0, dtype=torch.float32, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_triton_matches_torch(static, dtype):
    x = _randn(5, 96, seed=0, dtype=dtype)
    x[1] *= 100.0  # rows of very different ranges get their own scales
    x[3] = 0.0  # an all-zero row: a tiny scale, zeros out, no NaN
    static_scale = torch.tensor([0.05], device=DEVICE) if static else None
    q, s = quantize_rows_triton(x, static_scale)
    q_ref, s_ref = quantize_rows_reference(x, static_scale)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and s.shape == (5, 1) and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert_same_fp8(q, q_ref)  # the same fp32 division on both sides, so the same fp8 values
    if not static:
        assert q.float().abs().amax(dim=1)[[0, 1, 2, 4]].eq(FP8_MAX).all()  # every row reaches the fp8 range's end
        assert q[3].float().eq(0).all()
        # e4m3 keeps 3 mantissa bits: ~3% relative per element at most
        assert rel_err(q_ref.float() * s_ref, x.float()) < 0.05
    else:
        assert q.float().abs().max() <= FP8_MAX and torch.isfinite(q.float()).all()  # row 1 saturates, no NaN


def test_strided_rows_are_quantized_like_contiguous_ones():
    x = _randn(4, 160, seed=1)
    view = x[:, 32:]  # rows strided by 160, as a split of a fused projection's output would be
    q, s = quantize_rows_triton(view)
    q_ref, s_ref = quantize_rows_reference(view.contiguous())
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert_same_fp8(q, q_ref)


def test_weight_quantization_per_channel():
    w = _randn(48, 64, seed=2, scale=0.02)
    w[7] *= 50.0
    q, s = quantize_weight_per_channel(w)
    assert q.dtype == FP8_DTYPE and s.shape == (48,)
    assert torch.allclose(s, w.abs().amax(dim=1) / FP8_MAX)
    assert rel_err(q.float() * s[:, None], w) < 0.05
    assert q.float().abs().amax(dim=1).eq(FP8_MAX).all()


@pytest.mark.skipif(HAS_CUDA and not HAS_FP8_GPU, reason="fp8 GEMM needs sm89+")
@pytest.mark.parametrize("tensorwise", [False, True])
def test_scaled_mm_equals_the_dequantized_matmul(tensorwise):
    x = _randn(6, 64, seed=3)
    w = _randn(32, 64, seed=4, scale=0.1)
    if tensorwise:
        x_q, x_scale = quantize_rows_reference(x, torch.tensor([x.abs().max() / FP8_MAX], device=DEVICE))
        w_scale = torch.full((32,), float(w.abs().max() / FP8_MAX), device=DEVICE)
        w_q = (w / w_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        x_q, x_scale = quantize_rows_reference(x)
        w_q, w_scale = quantize_weight_per_channel(w)
    out_dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    bias = _randn(32, seed=5, dtype=out_dtype)
    y = scaled_mm(x_q, x_scale, w_q, w_scale, out_dtype, bias, tensorwise=tensorwise)
    assert y.dtype == out_dtype and y.shape == (6, 32)
    dequantized = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t() + bias.double()
    # the same fp8 operands: only fp32 accumulation (and a bf16 output on the GPU) differ
    assert rel_err(y, dequantized) < (1e-6 if out_dtype == torch.float32 else 8e-3)
    # and the fp8 product is within FP8 rounding of the unquantized one
    assert rel_err(y, x.double() @ w.double().t() + bias.double()) < 0.06


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("rows,k", [(48, 128), (40, 96)])
def test_fp8_gemv_matches_dequantized_reference(silu_mul, rows, k):
    x = _randn(1, k, seed=6, dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight_per_channel(_randn(rows, k, seed=7, scale=k ** -0.5))
    y = fp8_gemv(x, w_q, w_scale, silu_mul=silu_mul)
    dense = w_q.double() * w_scale.double()[:, None]
    ref = (x.double() @ dense.t()).to(torch.bfloat16)  # x is not quantized at batch 1
    if silu_mul:  # gate and up rounded to bf16, silu(gate) * up in fp32, as the kernel does
        gate, up = ref.float().chunk(2, dim=-1)
        ref = (F.silu(gate) * up).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    # the interpreter rounds fp32 -> bf16 toward zero (one bf16 step, 0.8%), a GPU to nearest
    assert rel_err(y, ref) < (1e-2 if DEVICE == "cuda" else 3e-2)


def test_fp8_gemv_refuses_mismatched_scales():
    x = _randn(1, 64, seed=8, dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight_per_channel(_randn(32, 64, seed=9))
    with pytest.raises(ValueError, match="fp32 scale"):
        gemv(x, w_q, weight_scale=w_scale[:16])
    with pytest.raises(ValueError, match="fp32 scale"):
        gemv(x, w_q, weight_scale=w_scale.to(torch.bfloat16))


# ---- GPU, Llama-3-8B shapes ----

LLAMA3_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with fp8 (sm89+)")
@pytest.mark.parametrize("name", list(LLAMA3_8B_SHAPES))
def test_gpu_fp8_gemv_llama3_8b_shapes(name):
    rows, k = LLAMA3_8B_SHAPES[name]
    x = _randn(1, k, seed=10, dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight_per_channel(_randn(rows, k, seed=11, scale=k ** -0.5))
    silu = name == "gate_up"
    y = fp8_gemv(x, w_q, w_scale, silu_mul=silu)
    ref = (x.float() @ (w_q.float() * w_scale[:, None]).t()).to(torch.bfloat16)
    if silu:
        ref = SiluAndMul().forward_native(ref)
    assert rel_err(y, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with fp8 (sm89+)")
@pytest.mark.parametrize("name", list(LLAMA3_8B_SHAPES))
@pytest.mark.parametrize("m", [2, 8, 16])
def test_gpu_small_batch_fp8_llama3_8b_shapes(name, m):
    """2..16 rows through the tc variant at the runtime's tile (MEASURED_FP8_SMALL_BATCH_CONFIGS): within its bound
    (x rounded to e4m3 per row and chunk) of the dequantized fp32 matmul."""
    rows, k = LLAMA3_8B_SHAPES[name]
    x = _randn(m, k, seed=23, dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight_per_channel(_randn(rows, k, seed=24, scale=k ** -0.5))
    silu = name == "gate_up"
    y = fp8_gemv(x, w_q, w_scale, silu_mul=silu)
    assert y.shape == (m, rows // 2 if silu else rows)
    excess, _ = fp8_gemv_error_excess(y, x, w_q, w_scale, silu, SMALL_BATCH_TC_CONFIG.error_bound)
    assert excess <= 1.0, excess


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with fp8 (sm89+)")
@pytest.mark.parametrize("m", [1, 7, 64, 512])
@pytest.mark.parametrize("tensorwise", [False, True])
def test_gpu_scaled_mm_rowwise_and_tensorwise(m, tensorwise):
    n, k = LLAMA3_8B_SHAPES["qkv"]
    x = _randn(m, k, seed=12, dtype=torch.bfloat16)
    w = _randn(n, k, seed=13, scale=k ** -0.5)
    static = torch.tensor([float(x.float().abs().max()) / FP8_MAX], device=DEVICE) if tensorwise else None
    x_q, x_scale = quantize_rows_triton(x, static)
    if tensorwise:
        w_scale = torch.full((n,), float(w.abs().max()) / FP8_MAX, device=DEVICE)
        w_q = (w / w_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        w_q, w_scale = quantize_weight_per_channel(w)
    y = scaled_mm(x_q, x_scale, w_q, w_scale, torch.bfloat16, tensorwise=tensorwise)
    ref = (x_q.float() * x_scale) @ (w_q.float() * w_scale[:, None]).t()
    assert rel_err(y, ref) < 8e-3
    assert rel_err(y, x.float() @ w.t()) < 0.06


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with fp8 (sm89+)")
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_gpu_fp8_linear_in_a_cuda_graph(batch):
    """The fp8 Linear's whole path (GEMV at batch 1, the tc variant to 16, quantize + _scaled_mm above) replays
    in a CUDA graph with the inputs changed in place, and matches its eager result."""
    from braid.runtime.layers.linear import Linear
    from braid.runtime.layers.quantization import Fp8LinearMethod

    torch.manual_seed(0)
    lin = Linear(4096, 2 * 1024, output_sizes=[1024, 1024], linear_method=Fp8LinearMethod())
    lin.weight = torch.nn.Parameter(_randn(2048, 4096, seed=14, scale=4096 ** -0.5, dtype=torch.bfloat16),
                                    requires_grad=False)
    lin.prepack_weights()
    assert lin.weight.dtype == FP8_DTYPE
    act = SiluAndMul()
    x = _randn(batch, 4096, seed=15, dtype=torch.bfloat16)
    eager = lin(x, act)
    static_x = x.clone()
    lin(static_x, act)  # warm-up: autotuning and compilation happen outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(static_x, act)
    x2 = _randn(batch, 4096, seed=16, dtype=torch.bfloat16)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, lin(x2, act)) < 1e-6
    ref = F.linear(x2.float(), lin.weight.float() * lin.weight_scale[:, None])
    assert rel_err(out, SiluAndMul().forward_native(ref.to(torch.bfloat16))) < 0.08
    assert rel_err(eager, lin(x, act)) < 1e-6
