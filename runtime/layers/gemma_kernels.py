"""Gemma-2's decode kernels: the sandwich norms in one kernel (a post-norm, the residual add, the next pre-norm),
and the final logit soft-cap with the cast to fp32 in one kernel.

A Gemma-2 layer norms each block's output before adding it to the residual stream (post_attention_layernorm,
post_feedforward_layernorm) and norms the stream again before the next block (pre_feedforward_layernorm, the next
layer's input_layernorm or the final norm). One kernel here does that chain per row,

    stream = round(residual + round(post_norm(x)));   out = round(next_norm(stream))

with HF's fp32 math and rounding points (each norm in fp32 from its input, rounded to the input dtype; the sum
rounded as `residual + hidden` is in PyTorch), so its results are those of the two separate kernels
(norm_kernels.rmsnorm, then fused_add_rmsnorm). Rows wider than ONE_TILE_MAX take those two kernels.

`post_norm_add_norm` runs the kernel on CUDA tensors (and under TRITON_INTERPRET=1 on CPU ones, which is how the
tests check it); elsewhere the RMSNorm modules' PyTorch reference. `soft_capped_fp32` is LMHead's
`tanh(logits.float() / cap) * cap` (four launches in PyTorch) as one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.activation_kernels import tanh
from braid.runtime.layers.kernel_inputs import FusedKernelInputError, rows_view
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["post_norm_add_norm", "fused_post_norm_add_norm", "soft_capped_fp32"]

ONE_TILE_MAX = 16384  # row elements kept in registers (Gemma-2: hidden 2304, 3584, 4608)


@triton.jit
def _post_norm_add_norm_kernel(
    x_ptr, res_ptr, w_post_ptr, w_next_ptr, out_ptr, res_out_ptr,
    x_stride, res_stride, out_stride, res_out_stride,
    N, eps_post, eps_next,
    BLOCK_N: tl.constexpr, UNIT_OFFSET: tl.constexpr, USE_PDL: tl.constexpr,
):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w_post = tl.load(w_post_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    w_next = tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w_post = w_post + 1.0
        w_next = w_next + 1.0
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps_post)
    normed = (x * rstd * w_post).to(dtype).to(tl.float32)  # the post-norm's output, in the model dtype
    stream = (r + normed).to(dtype)
    tl.store(res_out_ptr + row * res_out_stride + cols, stream, mask=mask)
    s = stream.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps_next)
    tl.store(out_ptr + row * out_stride + cols, (s * rstd * w_next).to(out_ptr.dtype.element_ty), mask=mask)


def fused_post_norm_add_norm(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
                             next_weight: torch.Tensor, post_eps: float, next_eps: float,
                             add_unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., N] of one dtype -> (next_norm(stream), stream) with stream = residual + post_norm(x), in
    one launch (two for rows wider than ONE_TILE_MAX). Norm weights [N]; add_unit_offset: they multiply as 1 + w."""
    n = x.shape[-1]
    for name, w in (("post_weight", post_weight), ("next_weight", next_weight)):
        if w.dim() != 1 or w.shape[0] != n or w.device != x.device:
            raise FusedKernelInputError(f"{name} {tuple(w.shape)} on {w.device} does not match hidden size {n} on "
                                        f"{x.device}")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise FusedKernelInputError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if n > ONE_TILE_MAX:
        from braid.runtime.layers import norm_kernels

        normed = norm_kernels.rmsnorm(x, post_weight, post_eps, add_unit_offset)
        return norm_kernels.fused_add_rmsnorm(normed, residual, next_weight, next_eps, add_unit_offset)
    x2, res2 = rows_view(x, "x"), rows_view(residual, "residual")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    stream = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(n)
        out2, stream2 = out.view(-1, n), stream.view(-1, n)
        _post_norm_add_norm_kernel[(rows,)](
            x2, res2, post_weight, next_weight, out2, stream2,
            x2.stride(0), res2.stride(0), out2.stride(0), stream2.stride(0),
            n, float(post_eps), float(next_eps),
            BLOCK_N=block, UNIT_OFFSET=bool(add_unit_offset), num_warps=max(1, min(16, block // 512)),
            **pdl.launch_options(x.device),
        )
    return out, stream


def post_norm_add_norm(x: torch.Tensor, residual: torch.Tensor, post_norm: RMSNorm,
                       next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (next_norm(residual + post_norm(x)), residual + post_norm(x)): one kernel on CUDA, else the modules
    themselves (their PyTorch reference on CPU)."""
    if x.is_cuda and residual.dtype == x.dtype and post_norm.add_unit_offset == next_norm.add_unit_offset:
        return fused_post_norm_add_norm(x, residual, post_norm.weight, next_norm.weight, post_norm.eps, next_norm.eps,
                                        post_norm.add_unit_offset)
    return next_norm(post_norm(x), residual)


SOFTCAP_BLOCK = 2048


@triton.jit
def _soft_cap_kernel(x_ptr, out_ptr, n, cap, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, tanh(x / cap) * cap, mask=mask)


def soft_capped_fp32(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """logits [..., V] in any float dtype -> tanh(logits / cap) * cap in fp32, one launch."""
    if cap <= 0:
        raise FusedKernelInputError(f"soft-cap must be > 0, got {cap}")
    x = logits.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        _soft_cap_kernel[(triton.cdiv(n, SOFTCAP_BLOCK),)](x, out, n, float(cap), BLOCK=SOFTCAP_BLOCK, num_warps=4,
                                                           **pdl.launch_options(x.device))
    return out
