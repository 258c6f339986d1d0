"""Rotary Triton kernels: rotate q and k in one launch, or rotate q and write the rotated k and v straight into
a layer's KV cache (the KV pool's fused rotate-and-store; only the pool calls that one).

Each public function is one kernel launch, allocates only by shape (CUDA-graph capturable) and also runs on
CPU tensors under TRITON_INTERPRET=1, which is how the tests check it without a GPU. All math is fp32.
Results are rounded to the input dtype at the same points as rotary.py's forward_native.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.kernel_inputs import FusedKernelInputError, token_rows_stride
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["apply_rotary", "apply_rotary_and_store_kv", "rotary_pairs"]

ROTARY_TILE_ELEMS = 2048


@triton.jit
def _rotate_heads(src_row, dst_row, src_head_stride, dst_head_stride, cos, sin, off1, off2, pair_mask,
                  rest_cols, rest_mask, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, COPY_REST: tl.constexpr):
    # cos, sin, off1, off2, pair_mask: [BLOCK_P] (one entry per rotated pair)
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        src = src_row + heads[:, None] * src_head_stride  # [BLOCK_H, 1]
        dst = dst_row + heads[:, None] * dst_head_stride
        m = (heads < NUM_HEADS)[:, None] & pair_mask[None, :]
        x1 = tl.load(src + off1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + off2[None, :], mask=m, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(dst + off1[None, :], o1.to(dst_row.dtype.element_ty), mask=m)
        tl.store(dst + off2[None, :], o2.to(dst_row.dtype.element_ty), mask=m)
        if COPY_REST:
            rm = (heads < NUM_HEADS)[:, None] & rest_mask[None, :]
            tl.store(dst + rest_cols[None, :], tl.load(src + rest_cols[None, :], mask=rm, other=0.0), mask=rm)


@triton.jit
def rotary_pairs(cache_ptr, pos, cache_stride, ROT_DIM: tl.constexpr, BLOCK_P: tl.constexpr, IS_NEOX: tl.constexpr):
    """The cos and sin of each rotated pair at position pos, and the pair's two offsets in a head:
    -> (cos, sin, off1, off2, pair_mask), each [BLOCK_P]."""
    pairs = tl.arange(0, BLOCK_P)
    pair_mask = pairs < ROT_DIM // 2
    # cache row: cos for each pair, then sin for each pair
    cos = tl.load(cache_ptr + pos * cache_stride + pairs, mask=pair_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + ROT_DIM // 2 + pairs, mask=pair_mask, other=0.0).to(tl.float32)
    if IS_NEOX:
        off1 = pairs
        off2 = pairs + ROT_DIM // 2
    else:
        off1 = pairs * 2
        off2 = pairs * 2 + 1
    return cos, sin, off1, off2, pair_mask


@triton.jit
def _rotary_kernel(
    pos_ptr, cache_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr,
    q_stride, q_head_stride, k_stride, k_head_stride,
    q_out_stride, q_out_head_stride, k_out_stride, k_out_head_stride, cache_stride,
    loc_ptr, v_ptr, v_cache_ptr, v_stride, v_cache_stride,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr, COPY_REST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_REST: tl.constexpr,
    STORE_KV: tl.constexpr, V_WIDTH: tl.constexpr, BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr,
):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    # STORE_KV: k_out is the layer's K cache and the rotated key goes to its slot loc[row]; v[row] is copied
    # to v_cache[loc[row]] (one launch for rotary and the KV write)
    k_out_row = row
    if STORE_KV:
        k_out_row = tl.load(loc_ptr + row).to(tl.int64)
        offs_v = tl.arange(0, BLOCK_V)
        mask_v = offs_v < V_WIDTH
        v_row = tl.load(v_ptr + row * v_stride + offs_v, mask=mask_v)
        tl.store(v_cache_ptr + k_out_row * v_cache_stride + offs_v, v_row, mask=mask_v)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cos, sin, off1, off2, pair_mask = rotary_pairs(cache_ptr, pos, cache_stride, ROT_DIM, BLOCK_P, IS_NEOX)
    rest_cols = ROT_DIM + tl.arange(0, BLOCK_REST)
    rest_mask = rest_cols < HEAD_DIM
    _rotate_heads(q_ptr + row * q_stride, q_out_ptr + row * q_out_stride, q_head_stride, q_out_head_stride,
                  cos, sin, off1, off2, pair_mask, rest_cols, rest_mask, NUM_Q_HEADS, BLOCK_H, COPY_REST)
    _rotate_heads(k_ptr + row * k_stride, k_out_ptr + k_out_row * k_out_stride, k_head_stride, k_out_head_stride,
                  cos, sin, off1, off2, pair_mask, rest_cols, rest_mask, NUM_K_HEADS, BLOCK_H, COPY_REST)


def _heads_view(x: torch.Tensor, name: str, tokens: int, head_dim: int) -> torch.Tensor:
    """[T, H*D] or [T, H, D] -> a [T, H, D] view of the same memory (unit stride within a head)."""
    if x.dim() == 2 and x.shape[0] == tokens and x.shape[1] % head_dim == 0:
        x3 = x.view(tokens, x.shape[1] // head_dim, head_dim)
    elif x.dim() == 3 and x.shape[0] == tokens and x.shape[2] == head_dim:
        x3 = x
    else:
        raise FusedKernelInputError(
            f"{name} must be [T={tokens}, heads * {head_dim}] or [T, heads, {head_dim}], got {tuple(x.shape)}")
    if head_dim > 1 and x3.stride(2) != 1:
        raise FusedKernelInputError(f"{name} must have unit stride within a head")
    return x3


def _check_rotary_inputs(positions, q, k, cos_sin_cache, head_dim, rotary_dim):
    """-> (rotary_dim, tokens, q as [T, H, D], k as [T, Hkv, D])."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise FusedKernelInputError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    if positions.dim() != 1:
        raise FusedKernelInputError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    tokens = positions.shape[0]
    q3, k3 = _heads_view(q, "q", tokens, head_dim), _heads_view(k, "k", tokens, head_dim)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim or cos_sin_cache.stride(1) != 1:
        raise FusedKernelInputError(
            f"cos_sin_cache must be [max_pos, {rotary_dim}] with unit last stride, got {tuple(cos_sin_cache.shape)}")
    for name, t in (("k", k), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != q.device:
            raise FusedKernelInputError(f"{name} is on {t.device}, q on {q.device}")
    return rotary_dim, tokens, q3, k3


def _launch_rotary(positions, cos_sin_cache, q3, k3, q_out3, k_out3, head_dim, rotary_dim, is_neox_style,
                   copy_rest, store=None):
    """store: None, or (loc [T], v [T, V_WIDTH] rows, v_cache [S, V_WIDTH] rows) when k_out3 is the K cache."""
    num_q_heads, num_k_heads = q3.shape[1], k3.shape[1]
    block_p = triton.next_power_of_2(rotary_dim // 2)
    block_h = max(1, min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), ROTARY_TILE_ELEMS // block_p))
    block_rest = triton.next_power_of_2(head_dim - rotary_dim) if copy_rest else 1
    if store is None:
        loc, v_rows, v_cache_rows, v_width = positions, q3, q3, 1
        v_stride = v_cache_stride = 0
    else:
        loc, v_rows, v_cache_rows = store
        v_width, v_stride, v_cache_stride = v_cache_rows.shape[1], v_rows.stride(0), v_cache_rows.stride(0)
    _rotary_kernel[(positions.shape[0],)](
        positions, cos_sin_cache, q3, k3, q_out3, k_out3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
        q_out3.stride(0), q_out3.stride(1), k_out3.stride(0), k_out3.stride(1), cos_sin_cache.stride(0),
        loc, v_rows, v_cache_rows, v_stride, v_cache_stride,
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim, ROT_DIM=rotary_dim,
        IS_NEOX=bool(is_neox_style), COPY_REST=copy_rest,
        BLOCK_P=block_p, BLOCK_H=block_h, BLOCK_REST=block_rest,
        STORE_KV=store is not None, V_WIDTH=v_width, BLOCK_V=triton.next_power_of_2(v_width),
        num_warps=4, **pdl.launch_options(q3.device),
    )


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 head_dim: int, rotary_dim: Optional[int] = None, is_neox_style: bool = True,
                 inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T]; q: [T, H*D] or [T, H, D]; k likewise with Hkv heads;
    cos_sin_cache: [max_pos, rotary_dim] (cos half, then sin half).

    Rotates the first rotary_dim dims of every head of q and k in one launch; rows and heads may be
    strided (slices of a fused qkv output). With inplace=True q and k are overwritten and returned;
    otherwise new contiguous tensors of the same shapes are returned. Positions are not range-checked
    (that would need a host sync).
    """
    rotary_dim, tokens, q3, k3 = _check_rotary_inputs(positions, q, k, cos_sin_cache, head_dim, rotary_dim)
    if inplace:
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    _launch_rotary(positions, cos_sin_cache, q3, k3, q_out.view(q3.shape), k_out.view(k3.shape), head_dim,
                   rotary_dim, is_neox_style, copy_rest=not inplace and rotary_dim < head_dim)
    return q_out, k_out


def apply_rotary_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cos_sin_cache: torch.Tensor, head_dim: int, rotary_dim: Optional[int],
                              is_neox_style: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              loc: torch.Tensor) -> bool:
    """One launch for a layer's rotary and KV write: q is rotated in place; the rotated k goes to
    k_cache[loc[t]] (k itself is left as it was) and v[t] to v_cache[loc[t]].

    k_cache: [S, Hkv, D], v_cache: [S, Hkv, Dv] contiguous; v: [T, Hkv*Dv] or [T, Hkv, Dv] with unit stride
    inside a row. Returns False (doing nothing) when the layouts or dtypes do not allow it, so the caller
    can rotate and store separately."""
    rotary_dim, tokens, q3, k3 = _check_rotary_inputs(positions, q, k, cos_sin_cache, head_dim, rotary_dim)
    v_width = v_cache[0].numel()
    v_rows = token_rows_stride(v, tokens, v_width)
    if (v_rows is None or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.dim() != 3 or k_cache.shape[1:] != k3.shape[1:]
            or loc.dim() != 1 or loc.shape[0] != tokens):
        return False
    if tokens:
        _launch_rotary(positions, cos_sin_cache, q3, k3, q3, k_cache, head_dim, rotary_dim, is_neox_style,
                       copy_rest=rotary_dim < head_dim,
                       store=(loc, v.as_strided((tokens, v_width), (v_rows, 1)), v_cache.view(-1, v_width)))
    return True
