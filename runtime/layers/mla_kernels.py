"""MLA decode: everything between the projections and the latent attention in one Triton launch.

Per token t: RMSNorm of the compressed latent, rotary on the shared rope key, both written as the token's cache row
[norm(latent) ; rot(k_pe)] at slot loc[t]; and the absorbed query q_full[t, h] = [q_nope[t, h] @ w_kc[h] ;
rot(q_pe[t, h])] for every head. Unfused this is a batched matmul, a norm, a rotary, two copies for the rotated
query, two concatenations and two indexed cache writes.

Program (token block, head, latent block) computes q_nope @ w_kc for BLOCK_T tokens x BLOCK_R latent columns of one
head (a tensor-core dot; at batch 1 this spreads w_kc over H * R / BLOCK_R programs, each loading its w_kc tile
before the PDL wait); the latent block 0 programs also rotate their head's q_pe, and those of head 0 write the
tokens' cache rows.

Rounding follows the unfused path: the matmul accumulates in fp32, the norm and the rotations run in fp32, each result
is rounded once to the cache's (= model) dtype. Allocates only by shape (CUDA-graph capturable); runs on CPU tensors
under TRITON_INTERPRET=1. Only the KV pool calls it (MLAKVPool.store_latent_and_build_query): the pool is the only
writer of KV.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.kernel_inputs import FusedKernelInputError
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel
from braid.runtime.layers.rotary_kernels import rotary_pairs

__all__ = ["mla_decode_prepare", "latent_to_head_values", "latent_values_gemv", "dequantized_head_weight",
           "LATENT_GEMV_MAX_TOKENS"]

# up to this many tokens latent_to_head_values streams w_vc as a GEMV (more take the batched matmul)
LATENT_GEMV_MAX_TOKENS = 8

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rotate_pair(x_ptr, out_ptr, off1, off2, cos, sin, mask):
    x1 = tl.load(x_ptr + off1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off2, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + off1, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + off2, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mla_decode_prepare_kernel(
    pos_ptr, loc_ptr, cache_ptr, latent_ptr, k_pe_ptr, norm_w_ptr, q_nope_ptr, w_kc_ptr, w_kc_scale_ptr, q_pe_ptr,
    kv_ptr, q_out_ptr, num_tokens, eps, cache_stride, latent_stride, k_pe_stride, q_nope_stride, q_nope_head_stride,
    w_kc_head_stride, w_kc_row_stride, q_pe_stride, q_pe_head_stride, kv_stride, q_out_stride, q_out_head_stride,
    R: tl.constexpr, NOPE: tl.constexpr, P: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_NOPE: tl.constexpr, R_POW2: tl.constexpr, BLOCK_P: tl.constexpr,
    FP32_DOT: tl.constexpr, W_SCALED: tl.constexpr, USE_PDL: tl.constexpr,
):
    let_next_kernel_launch(USE_PDL)
    head = tl.program_id(1)
    nope = tl.arange(0, BLOCK_NOPE)
    nope_mask = nope < NOPE
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < R
    # this head's w_kc tile [BLOCK_NOPE, BLOCK_R]: no kernel of the step writes it, so it loads before the wait
    w = tl.load(w_kc_ptr + head * w_kc_head_stride + nope[:, None] * w_kc_row_stride + r[None, :],
                mask=nope_mask[:, None] & r_mask[None, :], other=0.0)
    if W_SCALED:  # e4m3 rows times their scales [H, NOPE], rounded once to the query's dtype
        row_scale = tl.load(w_kc_scale_ptr + head * NOPE + nope, mask=nope_mask, other=0.0)
        w = (w.to(tl.float32) * row_scale[:, None]).to(q_nope_ptr.dtype.element_ty)
    wait_for_previous_kernel(USE_PDL)
    first = tl.program_id(0) * BLOCK_T
    tokens = first + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    q_nope = tl.load(q_nope_ptr + tokens.to(tl.int64)[:, None] * q_nope_stride + head * q_nope_head_stride
                     + nope[None, :], mask=t_mask[:, None] & nope_mask[None, :], other=0.0)
    if FP32_DOT:
        q_latent = tl.dot(q_nope.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        q_latent = tl.dot(q_nope, w)
    q_rows = q_out_ptr + tokens.to(tl.int64)[:, None] * q_out_stride + head * q_out_head_stride
    tl.store(q_rows + r[None, :], q_latent.to(q_out_ptr.dtype.element_ty), mask=t_mask[:, None] & r_mask[None, :])
    if tl.program_id(2) == 0:
        cols = tl.arange(0, R_POW2)
        col_mask = cols < R
        for t in range(first, tl.minimum(first + BLOCK_T, num_tokens)):  # int32 offsets: t * stride < 2^31
            pos = tl.load(pos_ptr + t).to(tl.int64)
            cos, sin, off1, off2, pair_mask = rotary_pairs(cache_ptr, pos, cache_stride, P, BLOCK_P, IS_NEOX)
            q_out_row = q_out_ptr + t * q_out_stride + head * q_out_head_stride + R
            _rotate_pair(q_pe_ptr + t * q_pe_stride + head * q_pe_head_stride, q_out_row, off1, off2,
                         cos, sin, pair_mask)
            if head == 0:
                # the token's cache row: [RMSNorm(latent) ; rot(k_pe)]
                kv_row = kv_ptr + tl.load(loc_ptr + t).to(tl.int64) * kv_stride
                x = tl.load(latent_ptr + t * latent_stride + cols, mask=col_mask, other=0.0)
                x = x.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / R + eps)
                norm_w = tl.load(norm_w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                tl.store(kv_row + cols, (x * rstd * norm_w).to(kv_ptr.dtype.element_ty), mask=col_mask)
                _rotate_pair(k_pe_ptr + t * k_pe_stride, kv_row + R, off1, off2, cos, sin, pair_mask)


def _unit_last_stride(**tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            raise FusedKernelInputError(f"{name} must have unit stride in its last dimension, got {tuple(x.stride())}")


def mla_decode_prepare(positions: torch.Tensor, loc: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox_style: bool,
                       latent: torch.Tensor, k_pe: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       q_nope: torch.Tensor, w_kc: torch.Tensor, q_pe: torch.Tensor,
                       kv_buffer: torch.Tensor, w_kc_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """positions, loc: [T]; cos_sin_cache: [max_pos, P] fp32 (cos half, sin half); latent: [T, R] before its
    norm; k_pe: [T, P] not rotated; norm_weight: [R]; q_nope: [T, H, nope]; w_kc: [H, nope, R] in q_nope's dtype, or
    e4m3 with w_kc_scale [H, nope] fp32 (one scale per row); q_pe: [T, H, P] not rotated; kv_buffer: the layer's cache
    [S, 1, R + P] (written at rows loc).
    Rows may be strided (slices of the projection output). -> q_full [T, H, R + P] in q_nope's dtype."""
    tokens, heads, nope = q_nope.shape
    rank = w_kc.shape[-1]
    rope = k_pe.shape[-1]
    if (latent.shape != (tokens, rank) or k_pe.shape != (tokens, rope) or q_pe.shape != (tokens, heads, rope)
            or w_kc.shape != (heads, nope, rank) or loc.shape != (tokens,) or norm_weight.shape != (rank,)
            or kv_buffer.dim() != 3 or kv_buffer.shape[1:] != (1, rank + rope) or cos_sin_cache.shape[1] != rope):
        raise FusedKernelInputError(
            f"MLA decode shapes disagree: positions {tuple(positions.shape)}, latent {tuple(latent.shape)}, k_pe "
            f"{tuple(k_pe.shape)}, q_nope {tuple(q_nope.shape)}, w_kc {tuple(w_kc.shape)}, q_pe "
            f"{tuple(q_pe.shape)}, kv_buffer {tuple(kv_buffer.shape)}, cos_sin_cache {tuple(cos_sin_cache.shape)}")
    if rope % 2:
        raise FusedKernelInputError(f"the rope dim must be even, got {rope}")
    _check_scaled_weight("w_kc", w_kc, w_kc_scale, q_nope.dtype)
    _unit_last_stride(latent=latent, k_pe=k_pe, q_nope=q_nope, w_kc=w_kc, q_pe=q_pe, kv_buffer=kv_buffer,
                      cos_sin_cache=cos_sin_cache)
    q_full = torch.empty((tokens, heads, rank + rope), dtype=q_nope.dtype, device=q_nope.device)
    if tokens == 0:
        return q_full
    block_t, block_r = 16, 64
    _mla_decode_prepare_kernel[(triton.cdiv(tokens, block_t), heads, triton.cdiv(rank, block_r))](
        positions, loc, cos_sin_cache, latent, k_pe, norm_weight, q_nope, w_kc,
        w_kc if w_kc_scale is None else w_kc_scale, q_pe, kv_buffer, q_full,
        tokens, float(eps), cos_sin_cache.stride(0), latent.stride(0), k_pe.stride(0), q_nope.stride(0),
        q_nope.stride(1), w_kc.stride(0), w_kc.stride(1), q_pe.stride(0), q_pe.stride(1), kv_buffer.stride(0),
        q_full.stride(0), q_full.stride(1),
        R=rank, NOPE=nope, P=rope, IS_NEOX=bool(is_neox_style), BLOCK_T=block_t, BLOCK_R=block_r,
        BLOCK_NOPE=max(16, triton.next_power_of_2(nope)), R_POW2=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(max(rope // 2, 1)),
        # fp32 inputs multiply in full fp32 (not tf32); so do 16-bit ones under Triton's interpreter, which
        # multiplies them wrongly as they are
        FP32_DOT=q_nope.dtype == torch.float32 or _INTERPRET, W_SCALED=w_kc_scale is not None,
        num_warps=4, **pdl.launch_options(q_nope.device),
    )
    return q_full


def _check_scaled_weight(name: str, w: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> None:
    """w in the activations' dtype without a scale, or e4m3 with fp32 per-row scales [H, rows] (contiguous)."""
    if scale is None:
        if w.dtype != dtype:
            raise FusedKernelInputError(f"{name} ({w.dtype}) must be {dtype}, or e4m3 with per-row scales")
        return
    if w.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or scale.shape != w.shape[:2] \
            or not scale.is_contiguous():
        raise FusedKernelInputError(f"{name} with scales must be e4m3 [H, rows, R] beside contiguous fp32 "
                                    f"[H, rows]; got {w.dtype} {tuple(w.shape)} and {scale.dtype} {tuple(scale.shape)}")


def dequantized_head_weight(w: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[H, rows, R] in dtype: w itself, or e4m3 rows times their scales [H, rows] (the batched-matmul paths)."""
    if scale is None:
        return w
    return (w.float() * scale[..., None]).to(dtype)


@triton.jit
def _latent_to_values_kernel(attn_ptr, w_vc_ptr, w_vc_scale_ptr, out_ptr, num_tokens, attn_stride, attn_head_stride,
                             out_stride, R: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr,
                             R_POW2: tl.constexpr, W_SCALED: tl.constexpr, USE_PDL: tl.constexpr):
    # out[t, h * V + c] = attn[t, h, :R] . w_vc[h, c, :R] for BLOCK_C value channels c of head h, every token
    let_next_kernel_launch(USE_PDL)
    head = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < V
    r = tl.arange(0, R_POW2)
    r_mask = r < R
    # the program's w_vc rows: no kernel of the step writes them, so they load before the wait
    w = tl.load(w_vc_ptr + head * V * R + channels[:, None] * R + r[None, :],
                mask=channel_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    if W_SCALED:  # e4m3 rows times their scales [H, V]
        w = w * tl.load(w_vc_scale_ptr + head * V + channels, mask=channel_mask, other=0.0)[:, None]
    wait_for_previous_kernel(USE_PDL)
    for t in range(num_tokens):  # int32 offsets: t * stride < 2^31
        a = tl.load(attn_ptr + t * attn_stride + head * attn_head_stride + r, mask=r_mask, other=0.0)
        values = tl.sum(w * a.to(tl.float32)[None, :], axis=1)
        tl.store(out_ptr + t * out_stride + head * V + channels, values.to(out_ptr.dtype.element_ty),
                 mask=channel_mask)


def latent_to_head_values(attn: torch.Tensor, w_vc: torch.Tensor,
                          w_vc_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """attn [T, H, R] (the attention output over the latent), w_vc [H, V, R] (attn's dtype, or e4m3 with per-row
    scales w_vc_scale [H, V] fp32) -> [T, H * V]: each head's value output attn[t, h] @ w_vc[h].T, the o_proj input.
    Up to LATENT_GEMV_MAX_TOKENS tokens on CUDA one PDL launch that streams w_vc once (programs of BLOCK_C channels of
    one head, every token; e4m3 rows are half the bytes), else a batched matmul (e4m3 dequantized for it)."""
    tokens, heads, rank = attn.shape
    if w_vc.dim() != 3 or w_vc.shape[0] != heads or w_vc.shape[2] != rank:
        raise FusedKernelInputError(f"w_vc must be [{heads}, V, {rank}], got {tuple(w_vc.shape)}")
    values = w_vc.shape[1]
    if not attn.is_cuda or tokens > LATENT_GEMV_MAX_TOKENS:
        _check_scaled_weight("w_vc", w_vc, w_vc_scale, attn.dtype)  # (latent_values_gemv checks its own)
        w = dequantized_head_weight(w_vc, w_vc_scale, attn.dtype)
        return torch.bmm(attn.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(tokens, heads * values)
    return latent_values_gemv(attn, w_vc, w_vc_scale)


def latent_values_gemv(attn: torch.Tensor, w_vc: torch.Tensor,
                       w_vc_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """latent_to_head_values' one launch (any T; CPU tensors under the interpreter)."""
    tokens, heads, rank = attn.shape
    values = w_vc.shape[1]
    if attn.stride(2) != 1 or not w_vc.is_contiguous():
        raise FusedKernelInputError("attn needs unit stride along R and w_vc must be contiguous")
    out = torch.empty(tokens, heads * values, dtype=attn.dtype, device=attn.device)
    if tokens == 0:
        return out
    block_c = 4
    _check_scaled_weight("w_vc", w_vc, w_vc_scale, attn.dtype)
    _latent_to_values_kernel[(heads, triton.cdiv(values, block_c))](
        attn, w_vc, w_vc if w_vc_scale is None else w_vc_scale, out, tokens, attn.stride(0), attn.stride(1),
        out.stride(0), R=rank, V=values, BLOCK_C=block_c, R_POW2=triton.next_power_of_2(rank),
        W_SCALED=w_vc_scale is not None, num_warps=4, **pdl.launch_options(attn.device))
    return out
