"""MLA decode: everything between the projections and the latent attention for one token in one Triton launch.

Per token t (one program): RMSNorm of the compressed latent, rotary on the shared rope key, both written as the
token's cache row [norm(latent) ; rot(k_pe)] at slot loc[t]; and the absorbed query assembled as
q_full[t, h] = [q_latent[h, t] ; rot(q_pe[t, h])] for every head. Unfused this is a norm, a rotary, two copies
for the rotated query, two concatenations and two indexed cache writes.

Rounding follows the unfused path: the norm and the rotations run in fp32 and are rounded once, to the cache's
(= model) dtype. Allocates only by shape (CUDA-graph capturable); runs on CPU tensors under TRITON_INTERPRET=1.
Only the KV pool calls it (MLAKVPool.store_latent_and_build_query): the pool is the only writer of KV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.kernel_inputs import FusedKernelInputError
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel
from braid.runtime.layers.rotary_kernels import rotary_pairs

__all__ = ["mla_decode_prepare"]


@triton.jit
def _rotate_pair(x_ptr, out_ptr, off1, off2, cos, sin, mask):
    x1 = tl.load(x_ptr + off1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off2, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + off1, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + off2, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mla_decode_prepare_kernel(
    pos_ptr, loc_ptr, cache_ptr, latent_ptr, k_pe_ptr, norm_w_ptr, q_latent_ptr, q_pe_ptr, kv_ptr, q_out_ptr,
    eps, cache_stride, latent_stride, k_pe_stride, q_latent_head_stride, q_latent_stride, q_pe_stride,
    q_pe_head_stride, kv_stride, q_out_stride, q_out_head_stride,
    R: tl.constexpr, P: tl.constexpr, H: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    kv_row = kv_ptr + tl.load(loc_ptr + t).to(tl.int64) * kv_stride

    # the latent, RMS-normed: [BLOCK_R]
    cols = tl.arange(0, BLOCK_R)
    col_mask = cols < R
    x = tl.load(latent_ptr + t * latent_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / R + eps)
    w = tl.load(norm_w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(kv_row + cols, (x * rstd * w).to(kv_ptr.dtype.element_ty), mask=col_mask)

    # rotary: one entry per rotated pair, [BLOCK_P]
    cos, sin, off1, off2, pair_mask = rotary_pairs(cache_ptr, pos, cache_stride, P, BLOCK_P, IS_NEOX)
    _rotate_pair(k_pe_ptr + t * k_pe_stride, kv_row + R, off1, off2, cos, sin, pair_mask)

    # the query of every head: [q_latent ; rot(q_pe)], BLOCK_H heads at a time
    q_out_row = q_out_ptr + t * q_out_stride
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_mask = heads < H
        lat = tl.load(q_latent_ptr + heads[:, None] * q_latent_head_stride + t * q_latent_stride + cols[None, :],
                      mask=head_mask[:, None] & col_mask[None, :], other=0.0)
        tl.store(q_out_row + heads[:, None] * q_out_head_stride + cols[None, :], lat,
                 mask=head_mask[:, None] & col_mask[None, :])
        m = head_mask[:, None] & pair_mask[None, :]
        _rotate_pair(q_pe_ptr + t * q_pe_stride + heads[:, None] * q_pe_head_stride,
                     q_out_row + heads[:, None] * q_out_head_stride + R, off1[None, :], off2[None, :],
                     cos[None, :], sin[None, :], m)


def _unit_last_stride(**tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            raise FusedKernelInputError(f"{name} must have unit stride in its last dimension, got {tuple(x.stride())}")


def mla_decode_prepare(positions: torch.Tensor, loc: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox_style: bool,
                       latent: torch.Tensor, k_pe: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       q_latent: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor) -> torch.Tensor:
    """positions, loc: [T]; cos_sin_cache: [max_pos, P] fp32 (cos half, sin half); latent: [T, R] before its
    norm; k_pe: [T, P] not rotated; norm_weight: [R]; q_latent: [H, T, R] (q_nope times w_kc, the bmm's output);
    q_pe: [T, H, P] not rotated; kv_buffer: the layer's cache [S, 1, R + P] (written at rows loc).
    Rows may be strided (slices of the projection output). -> q_full [T, H, R + P] in q_latent's dtype."""
    tokens = positions.shape[0]
    heads, _, rank = q_latent.shape
    rope = k_pe.shape[-1]
    if (latent.shape != (tokens, rank) or k_pe.shape != (tokens, rope) or q_pe.shape != (tokens, heads, rope)
            or q_latent.shape[1] != tokens or loc.shape != (tokens,) or norm_weight.shape != (rank,)
            or kv_buffer.dim() != 3 or kv_buffer.shape[1:] != (1, rank + rope) or cos_sin_cache.shape[1] != rope):
        raise FusedKernelInputError(
            f"MLA decode shapes disagree: positions {tuple(positions.shape)}, latent {tuple(latent.shape)}, k_pe "
            f"{tuple(k_pe.shape)}, q_latent {tuple(q_latent.shape)}, q_pe {tuple(q_pe.shape)}, kv_buffer "
            f"{tuple(kv_buffer.shape)}, cos_sin_cache {tuple(cos_sin_cache.shape)}")
    if rope % 2:
        raise FusedKernelInputError(f"the rope dim must be even, got {rope}")
    _unit_last_stride(latent=latent, k_pe=k_pe, q_latent=q_latent, q_pe=q_pe, kv_buffer=kv_buffer,
                      cos_sin_cache=cos_sin_cache)
    q_full = torch.empty((tokens, heads, rank + rope), dtype=q_latent.dtype, device=q_latent.device)
    if tokens == 0:
        return q_full
    block_r = triton.next_power_of_2(rank)
    _mla_decode_prepare_kernel[(tokens,)](
        positions, loc, cos_sin_cache, latent, k_pe, norm_weight, q_latent, q_pe, kv_buffer, q_full,
        float(eps), cos_sin_cache.stride(0), latent.stride(0), k_pe.stride(0), q_latent.stride(0), q_latent.stride(1),
        q_pe.stride(0), q_pe.stride(1), kv_buffer.stride(0), q_full.stride(0), q_full.stride(1),
        R=rank, P=rope, H=heads, IS_NEOX=bool(is_neox_style),
        BLOCK_R=block_r, BLOCK_P=triton.next_power_of_2(max(rope // 2, 1)),
        BLOCK_H=max(1, min(triton.next_power_of_2(heads), 4096 // block_r)),
        num_warps=4 if block_r <= 512 else 8, **pdl.launch_options(q_latent.device),
    )
    return q_full
