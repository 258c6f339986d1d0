"""RMSNorm Triton kernels: plain, and with the residual add fused in (the sum is rounded to the input dtype
first, as `x + residual` is in PyTorch; norm.py's forward_native is the reference).

Each public function is one kernel launch, allocates only by shape (CUDA-graph capturable) and also runs on
CPU tensors under TRITON_INTERPRET=1, which is how the tests check it without a GPU. All math is fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.kernel_inputs import FusedKernelInputError, rows_view
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["rmsnorm", "fused_add_rmsnorm"]

# rows up to this many elements stay in registers (one read of x); wider rows take two passes
RMSNORM_MAX_TILE = 16384
RMSNORM_CHUNK = 4096


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    x_stride, res_stride, out_stride, res_out_stride,
    N, eps,
    BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    res_row = res_ptr + row * res_stride
    out_row = out_ptr + row * out_stride
    res_out_row = res_out_ptr + row * res_out_stride
    if ONE_TILE:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            # the sum is rounded to the input dtype first, as `x + residual` is in PyTorch
            s = (x + r).to(x_ptr.dtype.element_ty)
            tl.store(res_out_row + cols, s, mask=mask)
            x = s.to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            w = w + 1.0
        tl.store(out_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(x_ptr.dtype.element_ty)
                tl.store(res_out_row + cols, s, mask=mask)
                x = s.to(tl.float32)
            acc += x * x
        var = tl.sum(acc, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        # the second pass re-reads the sum this program stored (residual_out may alias residual)
        tl.debug_barrier()
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            if HAS_RESIDUAL:
                x = tl.load(res_out_row + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if UNIT_OFFSET:
                w = w + 1.0
            tl.store(out_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise FusedKernelInputError(
            f"weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    if weight.device != x.device:
        raise FusedKernelInputError(f"weight is on {weight.device}, input on {x.device}")


def _launch_rmsnorm(x2, res2, weight, out2, res_out2, eps, add_unit_offset):
    rows, n = x2.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(n)
    one_tile = block <= RMSNORM_MAX_TILE
    if not one_tile:
        block = RMSNORM_CHUNK
    has_res = res2 is not None
    _rmsnorm_kernel[(rows,)](
        x2, res2 if has_res else x2, weight, out2, res_out2 if has_res else out2,
        x2.stride(0), res2.stride(0) if has_res else 0, out2.stride(0), res_out2.stride(0) if has_res else 0,
        n, float(eps),
        BLOCK_N=block, ONE_TILE=one_tile, HAS_RESIDUAL=has_res, UNIT_OFFSET=bool(add_unit_offset),
        num_warps=_num_warps(block), **pdl.launch_options(x2.device),
    )


def _out_rows(out: Optional[torch.Tensor], like: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise FusedKernelInputError(
            f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.dim() != 2 and not out.is_contiguous():
        raise FusedKernelInputError(f"{name} must be contiguous")
    out2 = out.view(-1, out.shape[-1]) if out.dim() != 2 else out
    if out2.shape[-1] > 1 and out2.stride(-1) != 1:
        raise FusedKernelInputError(f"{name} must have unit stride in its last dimension")
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, add_unit_offset: bool = False,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [..., N] -> x * rsqrt(mean(x^2) + eps) * (weight [+ 1]), in x.dtype."""
    _check_norm_inputs(x, weight)
    x2 = rows_view(x, "x")
    out = _out_rows(out, x, "out")
    _launch_rmsnorm(x2, None, weight, out.view(-1, x.shape[-1]), None, eps, add_unit_offset)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      add_unit_offset: bool = False, out: Optional[torch.Tensor] = None,
                      residual_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rmsnorm(x + residual), x + residual) in one pass.

    `residual_out=residual` updates the residual stream in place; `out=x` writes the normed rows over x.
    """
    _check_norm_inputs(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise FusedKernelInputError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    n = x.shape[-1]
    x2, res2 = rows_view(x, "x"), rows_view(residual, "residual")
    out = _out_rows(out, x, "out")
    residual_out = _out_rows(residual_out, x, "residual_out")
    _launch_rmsnorm(x2, res2, weight, out.view(-1, n), residual_out.view(-1, n), eps, add_unit_offset)
    return out, residual_out
