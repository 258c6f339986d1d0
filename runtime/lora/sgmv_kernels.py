"""The LoRA delta's two SGMV ops (runtime/lora/ops.py) as Triton kernels (CUDA): shrink h = A[idx] x, expand
y += scale[idx] * B[idx] h, every row on its own adapter slot, taken from the device tensor `idx` (-1: base row).

Both kernels tile rows by blocks of BLOCK_T rows. A program reads its rows' slots and loops over the distinct slots
among them (min of the slots not done yet, while any is left): per slot one tiled tl.dot against that slot's A (or
B) with the other rows masked off. A block of one request's prefill rows, or of batch-1 decode, takes one pass; a
decode block of rows on different adapters takes one pass per distinct adapter, each reading only that adapter's
weights. Above one block of rows the rows are visited in the order of a stable device argsort of idx (`row_order`,
computed once per idx tensor): each adapter's rows then form one segment, and a block meets only the adapters
whose segments it spans, each once (the segment formulation, found on the device with no host sync). Grids depend
only on shapes, so launches can be captured in a CUDA graph and replayed with other slots in the same idx buffer.

Shrink splits in_features over a third grid axis when the row and rank blocks alone would leave SMs idle (decode):
each split writes its own fp32 partial sum h_p [T, S*R], and expand adds the partials up as it loads h (no atomics,
so results do not depend on the order programs run in). Expand covers the S stacked output slices (qkv, gate_up) in
one launch: a column block runs each slice's product only for the slices its columns overlap.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from braid.runtime.layers.device_info import sm_count

__all__ = ["row_order", "sgmv_expand", "sgmv_shrink"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# above any slot: the min over the rows still to do ignores the rows already done
_NO_SLOT: tl.constexpr = tl.constexpr(2**31 - 1)


@triton.jit
def _block_rows(idx_ptr, order_ptr, T, BLOCK_T: tl.constexpr, USE_ORDER: tl.constexpr):
    """-> (rows [BLOCK_T] int64: rows of x / y, slots [BLOCK_T] int64: -1 past T, in_range [BLOCK_T]) of this
    program's row block."""
    pos = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = pos < T
    if USE_ORDER:
        rows = tl.load(order_ptr + pos, mask=in_range, other=0).to(tl.int64)
    else:
        rows = pos.to(tl.int64)
    slots = tl.load(idx_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    return rows, slots, in_range


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, idx_ptr, order_ptr, h_ptr, T, K, RT, k_per_split,
                        stride_xt, stride_xk, stride_an, stride_ar, stride_ak, stride_hp, stride_ht,
                        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_ORDER: tl.constexpr, FP32_DOT: tl.constexpr):
    # x [T, K], a [N, RT, K] (RT = S * R), h [P, T, RT] fp32 (column stride 1): split p's partial sum over
    # k in [p * k_per_split, (p + 1) * k_per_split). Grid: (row blocks, RT blocks, P).
    rows, slots, in_range = _block_rows(idx_ptr, order_ptr, T, BLOCK_T, USE_ORDER)
    cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < RT
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    todo = slots >= 0
    left = tl.sum(todo.to(tl.int32), axis=0)
    while left > 0:
        slot = tl.min(tl.where(todo, slots, _NO_SLOT), axis=0)
        sel = todo & (slots == slot)
        a_base = a_ptr + slot * stride_an
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            # x rows of other slots are masked to zero, so their rows of the product are zero
            xt = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk,
                         mask=sel[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
            at = tl.load(a_base + cols[None, :] * stride_ar + ks[:, None] * stride_ak,
                         mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_R] = A[slot]^T tile
            if FP32_DOT:
                acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, at.to(xt.dtype), acc)
        todo = todo & (slots != slot)
        left = tl.sum(todo.to(tl.int32), axis=0)
    # base rows (and rows of no slot) store zeros: every split writes its whole tile, so h needs no memset
    out = h_ptr + tl.program_id(2) * stride_hp + rows[:, None] * stride_ht + cols[None, :]
    tl.store(out, acc, mask=in_range[:, None] & col_ok[None, :])


@triton.jit
def _expand_slice(acc, h_ptr, b_ptr, sel, rows, cols, slot, scale, sub, off, out_s, R, P, stride_hp, stride_ht,
                  stride_bn, stride_bo, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  FP32_DOT: tl.constexpr):
    """acc [BLOCK_T, BLOCK_N] fp32 += scale * h[rows, sub*R : sub*R + R] @ B_sub[slot][cols - off]^T on the rows of
    sel (zero on the others), for the columns of this block inside slice `sub` (y columns [off, off + out_s));
    nothing when the block has none of them."""
    col_lo = tl.program_id(1) * BLOCK_N
    if (off < col_lo + BLOCK_N) & (off + out_s > col_lo):
        rk = tl.arange(0, BLOCK_R)
        r_ok = rk < R
        h_at = h_ptr + rows[:, None] * stride_ht + (sub * R + rk)[None, :]
        h_mask = sel[:, None] & r_ok[None, :]
        hs = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)  # summed over shrink's P partials
        for p in range(P):
            hs += tl.load(h_at + p * stride_hp, mask=h_mask, other=0.0).to(tl.float32)
        hs *= scale
        within = cols - off
        c_ok = (within >= 0) & (within < out_s)
        bt = tl.load(b_ptr + slot * stride_bn + within[None, :] * stride_bo + rk[:, None],
                     mask=c_ok[None, :] & r_ok[:, None], other=0.0)  # [BLOCK_R, BLOCK_N] = B_sub[slot]^T tile
        hs = hs.to(bt.dtype)  # scale * h rounded to the weights' type before the product, as the torch path does
        if FP32_DOT:
            acc = tl.dot(hs.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(hs, bt, acc)
    return acc


@triton.jit
def _sgmv_expand_kernel(y_ptr, h_ptr, b0_ptr, b1_ptr, b2_ptr, scale_ptr, idx_ptr, order_ptr, T, OUT, R, P,
                        out0, out1, out2, stride_yt, stride_hp, stride_ht,
                        stride_b0n, stride_b0o, stride_b1n, stride_b1o, stride_b2n, stride_b2o,
                        S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        USE_ORDER: tl.constexpr, FP32_DOT: tl.constexpr):
    # y [T, OUT] (column stride 1, OUT = out0 + out1 + out2 with out_s = 0 past S), updated in place on rows with a
    # slot; h [P, T, S * R] partial sums (column stride 1); b_s [N, out_s, R] (R stride 1) for y columns
    # [out0 + .. + out_{s-1}, + out_s); scale [N]. Grid: (row blocks, OUT blocks of BLOCK_N).
    rows, slots, _ = _block_rows(idx_ptr, order_ptr, T, BLOCK_T, USE_ORDER)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    todo = slots >= 0
    live = todo
    left = tl.sum(todo.to(tl.int32), axis=0)
    while left > 0:
        slot = tl.min(tl.where(todo, slots, _NO_SLOT), axis=0)
        sel = todo & (slots == slot)
        scale = tl.load(scale_ptr + slot).to(tl.float32)
        acc = _expand_slice(acc, h_ptr, b0_ptr, sel, rows, cols, slot, scale, 0, 0, out0, R, P, stride_hp,
                            stride_ht, stride_b0n, stride_b0o, BLOCK_T, BLOCK_N, BLOCK_R, FP32_DOT)
        if S > 1:
            acc = _expand_slice(acc, h_ptr, b1_ptr, sel, rows, cols, slot, scale, 1, out0, out1, R, P, stride_hp,
                                stride_ht, stride_b1n, stride_b1o, BLOCK_T, BLOCK_N, BLOCK_R, FP32_DOT)
        if S > 2:
            acc = _expand_slice(acc, h_ptr, b2_ptr, sel, rows, cols, slot, scale, 2, out0 + out1, out2, R, P,
                                stride_hp, stride_ht, stride_b2n, stride_b2o, BLOCK_T, BLOCK_N, BLOCK_R, FP32_DOT)
        todo = todo & (slots != slot)
        left = tl.sum(todo.to(tl.int32), axis=0)
    # rows without a slot are neither read nor written: the base output stays bit for bit
    mask = live[:, None] & (cols < OUT)[None, :]
    at = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    y = tl.load(at, mask=mask, other=0.0)
    tl.store(at, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def programs_wanted(device: torch.device) -> int:
    """The SM count of `device`: how many programs keep it busy (4 for the interpreter's CPU tensors)."""
    if device.type != "cuda":
        return 4  # the interpreter: enough to run the split path in tests
    return sm_count(device)


def _fp32_dot(dtype: torch.dtype) -> bool:
    # fp32 weights: full-precision products (not TF32), as torch.matmul's default. The interpreter dots bf16 / fp16
    # operands as their raw bits, so it gets fp32 copies of them.
    return dtype == torch.float32 or _INTERPRET


def _row_block(t: int) -> int:
    # decode-sized batches: the smallest tile tl.dot takes; prefill: fewer blocks, so fewer re-reads of each A / B
    return 16 if t <= 256 else 64


_order_cache: list = [None]  # (weakref to idx, idx._version, order)


def row_order(idx: torch.Tensor, block_t: Optional[int] = None) -> Optional[torch.Tensor]:
    """idx [T] -> a stable argsort of it ([T] int64, on idx's device), or None where T fits one row block (order is
    then moot). Kept for the last idx tensor seen (same object, unchanged in place): every linear of a forward pass
    passes the same one, so the sort runs once per pass. The kernels give the same result for any permutation of
    the rows (it only decides which rows share a block): an order left from other contents of a CUDA graph's idx
    buffer costs speed, never correctness. A graph holds the sort (redone on every replay) when its capture makes
    the first call after the idx buffer was last written."""
    if idx.shape[0] <= (block_t or _row_block(idx.shape[0])):
        return None
    # an inference tensor (a CUDA graph's idx buffer made under inference_mode) keeps no version counter: the same
    # object then stands for the same contents, which holds within one forward pass
    version = None if idx.is_inference() else idx._version
    cached = _order_cache[0]
    if cached is not None and cached[0]() is idx and cached[1] == version:
        return cached[2]
    order = torch.sort(idx, stable=True).indices
    _order_cache[0] = (weakref.ref(idx), version, order)
    return order


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, order: Optional[torch.Tensor] = None, *,
                block_t: Optional[int] = None, block_k: Optional[int] = None,
                split_k: Optional[int] = None) -> torch.Tensor:
    """x [T, in], a [N, RT, in], idx [T] (slot per row, -1 base), order [T] (row_order(idx)) or None (rows in
    order) -> h partials [P, T, RT] fp32, h = sum over dim 0 (zero rows where idx < 0). Block sizes and the split
    count P are chosen from the shapes unless given (tests)."""
    t, k = x.shape
    rt = a.shape[1]
    if t == 0:
        return torch.zeros(1, 0, rt, dtype=torch.float32, device=x.device)
    block_t = block_t or _row_block(t)
    block_r = min(64, max(16, triton.next_power_of_2(rt)))
    block_k = block_k or min(64, max(16, triton.next_power_of_2(k)))
    chunks = triton.cdiv(k, block_k)
    programs = triton.cdiv(t, block_t) * triton.cdiv(rt, block_r)
    # one program per SM where the row and rank blocks leave them idle; at most 512 partial rows per row block,
    # since every column block of expand reads all of them
    split = split_k or max(1, min(64, chunks, programs_wanted(x.device) // programs, 512 // min(t, block_t)))
    k_per_split = triton.cdiv(chunks, split) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    h = torch.empty(split, t, rt, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(t, block_t), triton.cdiv(rt, block_r), split)
    _sgmv_shrink_kernel[grid](x, a, idx, order if order is not None else idx, h, t, k, rt, k_per_split,
                              x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
                              h.stride(1), BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k,
                              USE_ORDER=order is not None, FP32_DOT=_fp32_dot(x.dtype),
                              num_warps=1 if _INTERPRET else 4)
    return h


def sgmv_expand(y: torch.Tensor, h: torch.Tensor, b_stacks: Sequence[torch.Tensor], scale: torch.Tensor,
                idx: torch.Tensor, order: Optional[torch.Tensor] = None, *, block_t: Optional[int] = None,
                block_n: Optional[int] = None) -> torch.Tensor:
    """y [T, sum(out_s)] += per row scale[idx] * h_s @ B_s[idx]^T on each slice s (rows with idx < 0 untouched), in
    place; returns y. h: [T, S * R] or sgmv_shrink's partials [P, T, S * R]; b_stacks: S <= 3 tensors
    [N, out_s, R]; scale [N]; order as for sgmv_shrink."""
    if not 1 <= len(b_stacks) <= 3:
        raise ValueError(f"LoRA expand takes 1 to 3 stacked slices, not {len(b_stacks)}")
    if y.stride(-1) != 1:
        raise ValueError("LoRA expand: y needs unit column stride")
    h = h if h.dim() == 3 else h.unsqueeze(0)
    h = h if h.stride(-1) == 1 else h.contiguous()
    bs = [b if b.stride(-1) == 1 else b.contiguous() for b in b_stacks]
    t = y.shape[0]
    rank = h.shape[2] // len(bs)
    outs = [b.shape[1] for b in bs] + [0] * (3 - len(bs))
    if sum(outs) != y.shape[1]:
        raise ValueError(f"LoRA expand: slices of {outs[:len(bs)]} columns for y of {y.shape[1]}")
    if t == 0:
        return y
    pad = bs + [bs[0]] * (3 - len(bs))  # unused pointers (out_s = 0 there)
    block_t = block_t or _row_block(t)
    block_n = block_n or (32 if _INTERPRET else 128)
    grid = (triton.cdiv(t, block_t), triton.cdiv(y.shape[1], block_n))
    _sgmv_expand_kernel[grid](y, h, pad[0], pad[1], pad[2], scale, idx, order if order is not None else idx, t,
                              y.shape[1], rank, h.shape[0], outs[0], outs[1], outs[2], y.stride(0), h.stride(0),
                              h.stride(1), pad[0].stride(0), pad[0].stride(1), pad[1].stride(0), pad[1].stride(1),
                              pad[2].stride(0), pad[2].stride(1), S=len(bs), BLOCK_T=block_t, BLOCK_N=block_n,
                              BLOCK_R=max(16, triton.next_power_of_2(rank)), USE_ORDER=order is not None,
                              FP32_DOT=_fp32_dot(bs[0].dtype),
                              num_warps=1 if _INTERPRET else 8 if block_t * block_n >= 8192 else 4)
    return y
