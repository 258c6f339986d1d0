"""Fused Triton kernels for the per-token layers: RMSNorm (with the residual add), gated activations, rotary.

Each public function is one kernel launch, allocates only by shape (CUDA-graph capturable) and also runs
on CPU tensors under TRITON_INTERPRET=1, which is how the tests check it without a GPU. All math is fp32;
results are rounded to the input dtype at the same points as the PyTorch reference paths in norm.py,
activation.py and rotary.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = [
    "rmsnorm",
    "fused_add_rmsnorm",
    "silu_and_mul",
    "gelu_and_mul",
    "apply_rotary",
    "apply_rotary_and_store_kv",
    "store_kv",
]

# rows up to this many elements stay in registers (one read of x); wider rows take two passes
RMSNORM_MAX_TILE = 16384
RMSNORM_CHUNK = 4096
ACT_BLOCK = 1024
ROTARY_TILE_ELEMS = 2048

_SILU, _GELU_TANH, _GELU_ERF = 0, 1, 2


class FusedKernelInputError(ValueError):
    """Tensors of the wrong shape, layout or device for a fused kernel."""


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """-> a 2-D view [rows, last dim] with unit stride in the last dim (a copy only if no such view exists)."""
    if x.dim() == 0:
        raise FusedKernelInputError(f"{name} must have at least one dimension")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


# ---------------------------------------------------------------------------------------------- RMSNorm


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
    x2 = _rows(x, "x")
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
    x2, res2 = _rows(x, "x"), _rows(residual, "residual")
    out = _out_rows(out, x, "out")
    residual_out = _out_rows(residual_out, x, "residual_out")
    _launch_rmsnorm(x2, res2, weight, out.view(-1, n), residual_out.view(-1, n), eps, add_unit_offset)
    return out, residual_out


# ---------------------------------------------------------------------------------------- activations


@triton.jit
def _tanh(z):
    # |z| >= 15 already rounds tanh to +-1 in fp32; the clamp keeps e^2z finite
    z = tl.minimum(tl.maximum(z, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, I, BLOCK: tl.constexpr, ACT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    x_row = x_ptr + row * x_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
        act = 0.5 * gate * (1.0 + _tanh(inner))
    else:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    # the activation is rounded to the output dtype before the product, as in PyTorch's two ops
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int, out: Optional[torch.Tensor]) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise FusedKernelInputError(f"last dimension must be even (gate then up), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x2 = _rows(x, "x")
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
                              num_warps=max(1, min(4, block // 256)))
    return out


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [..., 2I] -> silu(x[..., :I]) * x[..., I:]: [..., I]."""
    return _act_and_mul(x, _SILU, out)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [..., 2I] -> gelu(x[..., :I], approximate) * x[..., I:]: [..., I]; approximate is 'tanh' or 'none'."""
    if approximate not in ("tanh", "none"):
        raise FusedKernelInputError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _act_and_mul(x, _GELU_TANH if approximate == "tanh" else _GELU_ERF, out)


# --------------------------------------------------------------------------------------------- rotary


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
    v_rows = _token_rows(v, tokens, v_width)
    if (v_rows is None or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.dim() != 3 or k_cache.shape[1:] != k3.shape[1:]
            or loc.dim() != 1 or loc.shape[0] != tokens):
        return False
    if tokens:
        _launch_rotary(positions, cos_sin_cache, q3, k3, q3, k_cache, head_dim, rotary_dim, is_neox_style,
                       copy_rest=rotary_dim < head_dim,
                       store=(loc, v.as_strided((tokens, v_width), (v_rows, 1)), v_cache.view(-1, v_width)))
    return True


# ---------------------------------------------------------------------------------------------- KV store


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, loc_ptr, k_cache_ptr, v_cache_ptr, k_row_stride, v_row_stride,
                     k_cache_row_stride, v_cache_row_stride,
                     K_WIDTH: tl.constexpr, V_WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K_WIDTH
    row_k = tl.load(k_ptr + t.to(tl.int64) * k_row_stride + offs_k, mask=mask_k)
    tl.store(k_cache_ptr + slot * k_cache_row_stride + offs_k, row_k, mask=mask_k)
    offs_v = tl.arange(0, BLOCK_V)
    mask_v = offs_v < V_WIDTH
    row_v = tl.load(v_ptr + t.to(tl.int64) * v_row_stride + offs_v, mask=mask_v)
    tl.store(v_cache_ptr + slot * v_cache_row_stride + offs_v, row_v, mask=mask_v)


def _token_rows(x: torch.Tensor, tokens: int, width: int) -> Optional[int]:
    """Row stride of x viewed as [tokens, width] with unit stride inside a row, or None if it has no such view."""
    if x.numel() != tokens * width:
        return None
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x.stride(0)
    if x.dim() == 2 and x.stride(1) == 1:
        return x.stride(0)
    return None


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> bool:
    """k_cache: [S, Hkv, D], v_cache: [S, Hkv, Dv] contiguous; loc: [T] slots; k: [T, Hkv*D] or [T, Hkv, D]
    (rows may be strided, e.g. slices of a fused qkv output), v likewise.

    Writes k[t] to k_cache[loc[t]] and v[t] to v_cache[loc[t]] in one launch. Returns False (writing nothing)
    when the layouts or dtypes do not allow it, so the caller can fall back to indexed assignment."""
    tokens = loc.numel()
    k_width, v_width = k_cache[0].numel(), v_cache[0].numel()
    k_rows, v_rows = _token_rows(k, tokens, k_width), _token_rows(v, tokens, v_width)
    if (k_rows is None or v_rows is None or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or loc.dim() != 1):
        return False
    if tokens:
        _store_kv_kernel[(tokens,)](
            k, v, loc, k_cache, v_cache, k_rows, v_rows, k_width, v_width,
            K_WIDTH=k_width, V_WIDTH=v_width, BLOCK_K=triton.next_power_of_2(k_width),
            BLOCK_V=triton.next_power_of_2(v_width), num_warps=4)
    return True
