"""Gated activation Triton kernels: silu(gate) * up and gelu(gate) * up over [..., 2I] rows (gate, then up).

Each public function is one kernel launch, allocates only by shape (CUDA-graph capturable) and also runs on
CPU tensors under TRITON_INTERPRET=1, which is how the tests check it without a GPU. All math is fp32. The kernel
launches with PDL where the device has it (layers/pdl.py), so that where it runs between PDL kernels of a decode
step (after a LoRA delta, which keeps the activation out of the batch-1 GEMV) the chain stays overlapped.
The activation is rounded to the output dtype before the product, as in activation.py's forward_native.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.kernel_inputs import FusedKernelInputError, rows_view
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["silu_and_mul", "gelu_and_mul", "gelu_tanh", "tanh"]

ACT_BLOCK = 1024

_SILU, _GELU_TANH, _GELU_ERF = 0, 1, 2


@triton.jit
def tanh(z):
    # |z| >= 15 already rounds tanh to +-1 in fp32; the clamp keeps e^2z finite
    z = tl.minimum(tl.maximum(z, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def gelu_tanh(gate):
    """GELU with the tanh approximation, in fp32 (also the batch-1 GEMV's fused epilogue: gemv.py)."""
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
    return 0.5 * gate * (1.0 + tanh(inner))


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, I, BLOCK: tl.constexpr, ACT: tl.constexpr,
                        USE_PDL: tl.constexpr):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    x_row = x_ptr + row * x_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:
        act = gelu_tanh(gate)
    else:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    # the activation is rounded to the output dtype before the product, as in PyTorch's two ops
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int, out: Optional[torch.Tensor]) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise FusedKernelInputError(f"last dimension must be even (gate then up), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x2 = rows_view(x, "x")
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], inter) or out.dtype != x.dtype or out.device != x.device:
        raise FusedKernelInputError(
            f"out must be {(*x.shape[:-1], inter)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    elif not out.is_contiguous():
        raise FusedKernelInputError("out must be contiguous")
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(ACT_BLOCK, triton.next_power_of_2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](x2, out, x2.stride(0), inter, inter, BLOCK=block, ACT=act,
                              num_warps=max(1, min(4, block // 256)), **pdl.launch_options(x.device))
    return out


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [..., 2I] -> silu(x[..., :I]) * x[..., I:]: [..., I]."""
    return _act_and_mul(x, _SILU, out)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [..., 2I] -> gelu(x[..., :I], approximate) * x[..., I:]: [..., I]; approximate is 'tanh' or 'none'."""
    if approximate not in ("tanh", "none"):
        raise FusedKernelInputError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _act_and_mul(x, _GELU_TANH if approximate == "tanh" else _GELU_ERF, out)
