"""Triton decode attention over the paged KV cache (page size 1), split-KV in two stages.

Each request has one new query token at position seq_lens[b] - 1 that attends to its keys at positions
[0, seq_lens[b]) (slots `req_to_token[req_pool_indices[b], pos]`), or, with a sliding window W > 0, to
the last W of them (positions (p - W, p], the Gemma-2 / Mistral convention).

Stage 1, grid (B, Hkv * head_blocks, num_kv_splits): one program takes up to BLOCK_H query heads that
share a KV head (GQA) and one split of the visible keys, so every KV tile is read once per group. It
writes the split's normalised partial output and its base-2 log-sum-exp into
attn_logits[b, h, split, :Dv] and attn_logits[b, h, split, Dv].
Stage 2, grid (B, H): merges the splits, BLOCK_S of them per load (one memory round trip for up to BLOCK_S
splits instead of one per split: at 8K context every split is in use, and the merge was a chain of 16 dependent
L2 reads per layer).
(Merging in stage 1 instead, by the last program of each head block to finish, was measured slower on an H100:
docs/benchmark_history.md, session 16.)

Splits cover ceil(len / num_kv_splits) keys rounded up to a whole BLOCK_N tile, so short sequences use
fewer splits (the rest exit at once); the split count stays fixed, which CUDA graphs need.
Values read from fp8 buffers are multiplied by k_scale / v_scale (the pool stores x / scale).

Triton keeps one shared-memory buffer for K and V tiles gathered through slots loaded in the same iteration, whatever
num_stages says, so a program's next tile loads only after this one's dots. ROWS_AHEAD (a launch-config key) loads each
tile's slots one iteration ahead; the K/V loads then depend on no load of their iteration, and num_stages >= 3 gives
them num_stages - 1 buffers (benchmarks/decode_attention_occupancy.py shows the shared memory it takes).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.dtypes import FP8_DTYPES
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel
from braid.runtime.layers.attention.triton_ops.extend_attention import (
    _attend_tile,
    check_last_dim_contiguous,
    dot_dtype,
    launch_first_fitting,
    split_head_dim,
)

__all__ = ["decode_attention_fwd"]


@triton.jit
def _split_bounds(seq_len, sliding_window, num_kv_splits, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """-> (first visible key, keys per split, number of non-empty splits)."""
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(0, seq_len - sliding_window)
    kv_len = seq_len - kv_start
    split_len = tl.cdiv(tl.cdiv(kv_len, num_kv_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, BLOCK_N)
    return kv_start, split_len, tl.cdiv(kv_len, split_len)


@triton.jit
def _merge_splits(att_head, o_head, n_splits, stride_as, offs_dv, mask_dv, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """One head's n_splits partial outputs and log-sum-exps (att_head: its [splits, Dv + 1] rows of attn_logits) ->
    the softmax-weighted sum at o_head; zeros for n_splits == 0 (padding rows of a CUDA-graph batch have no keys)."""
    offs_s = tl.arange(0, BLOCK_S)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        # BLOCK_S splits at once: parts [BLOCK_S, BLOCK_DV], their log-sum-exps [BLOCK_S] (-inf past n_splits)
        splits = s0 + offs_s
        mask_s = splits < n_splits
        lse = tl.load(att_head + splits * stride_as + DV, mask=mask_s, other=float("-inf"))
        parts = tl.load(att_head + splits[:, None] * stride_as + offs_dv[None, :],
                        mask=mask_s[:, None] & mask_dv[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))  # finite: the chunk holds at least one split
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
        l = l * alpha + tl.sum(w, axis=0)
        m = m_new
    l = tl.where(l == 0.0, 1.0, l)
    tl.store(o_head + offs_dv, (acc / l).to(o_head.dtype.element_ty), mask=mask_dv)


@triton.jit
def _decode_stage1_kernel(
    Q, K_buf, V_buf, Req_to_token, B_req_idx, B_seq_len, Att,
    sm_scale, logit_cap, sliding_window, num_kv_splits, v_scale,
    stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_req,
    stride_ab, stride_ah, stride_as,
    KV_GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, CLAMP_Q: tl.constexpr,
    STAGE_V: tl.constexpr, USE_PDL: tl.constexpr, ROWS_AHEAD: tl.constexpr,
):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    cur_batch = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    cur_kv_head = pid_h // HEAD_BLOCKS

    seq_len = tl.load(B_seq_len + cur_batch)
    kv_start, split_len, n_splits = _split_bounds(seq_len, sliding_window, num_kv_splits, BLOCK_N, USE_WINDOW)
    if split >= n_splits:
        return
    split_lo = kv_start + split * split_len
    split_hi = tl.minimum(split_lo + split_len, seq_len)

    in_group = (pid_h % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < KV_GROUP
    offs_h = cur_kv_head * KV_GROUP + in_group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV

    # q: [BLOCK_H, BLOCK_D]
    q_base = Q + cur_batch.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q = tl.load(q_base + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < D
        qpe = tl.load(q_base + offs_dpe[None, :], mask=mask_h[:, None] & mask_dpe[None, :], other=0.0)
    else:  # unused placeholders
        offs_dpe, mask_dpe, qpe = offs_d, mask_d, q
    if CLAMP_Q:  # bf16 queries dotted in fp16
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
        qpe = tl.minimum(tl.maximum(qpe.to(tl.float32), -65504.0), 65504.0)

    req_row = Req_to_token + tl.load(B_req_idx + cur_batch).to(tl.int64) * stride_req
    K_h = K_buf + cur_kv_head * stride_kbh
    V_h = V_buf + cur_kv_head * stride_vbh
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    # split_len is a whole number of tiles: only the sequence's last tile can be partial
    full_hi = split_lo + (split_hi - split_lo) // BLOCK_N * BLOCK_N
    if ROWS_AHEAD:
        rows_next = tl.load(req_row + split_lo + offs_n, mask=split_lo + offs_n < full_hi, other=0)
    for start_n in range(split_lo, full_hi, BLOCK_N):
        offs_kv = start_n + offs_n
        if ROWS_AHEAD:
            # the tile's slots were loaded one iteration ahead, so its K/V loads depend on no load of this iteration
            rows = rows_next.to(tl.int64)
            rows_next = tl.load(req_row + offs_kv + BLOCK_N, mask=offs_kv + BLOCK_N < full_hi, other=0)
        else:
            rows = tl.load(req_row + offs_kv).to(tl.int64)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qpe, offs_h, offs_kv, rows, offs_kv < split_hi, offs_n,
            K_h, V_h, stride_kbs, stride_vbs, offs_d, mask_d, offs_dpe, mask_dpe, offs_dv, mask_dv,
            sm_scale, logit_cap, sliding_window, 1.0,
            BLOCK_DPE, False, False, USE_CAP, False, False, DOT_DTYPE, STAGE_V, False)
    if full_hi < split_hi:
        offs_kv = full_hi + offs_n
        mask_n = offs_kv < split_hi
        rows = tl.load(req_row + offs_kv, mask=mask_n, other=0).to(tl.int64)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qpe, offs_h, offs_kv, rows, mask_n, offs_n,
            K_h, V_h, stride_kbs, stride_vbs, offs_d, mask_d, offs_dpe, mask_dpe, offs_dv, mask_dv,
            sm_scale, logit_cap, sliding_window, 1.0,
            BLOCK_DPE, True, False, USE_CAP, False, False, DOT_DTYPE, STAGE_V, False)

    att_base = Att + cur_batch.to(tl.int64) * stride_ab + offs_h * stride_ah + split * stride_as
    tl.store(att_base[:, None] + offs_dv[None, :], acc * (v_scale / l_i)[:, None],
             mask=mask_h[:, None] & mask_dv[None, :])
    tl.store(att_base + DV, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    Att, O, B_seq_len,
    sliding_window, num_kv_splits,
    stride_ab, stride_ah, stride_as, stride_ob, stride_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    seq_len = tl.load(B_seq_len + cur_batch)
    _, _, n_splits = _split_bounds(seq_len, sliding_window, num_kv_splits, BLOCK_N, USE_WINDOW)

    offs_dv = tl.arange(0, BLOCK_DV)
    _merge_splits(Att + cur_batch.to(tl.int64) * stride_ab + cur_head * stride_ah,
                  O + cur_batch.to(tl.int64) * stride_ob + cur_head * stride_oh, n_splits, stride_as, offs_dv,
                  offs_dv < DV, DV, BLOCK_DV, BLOCK_S)


# ---------------------------------------------------------------- host side

_BLOCK_H = 16  # query heads per stage-1 program (a dot needs >= 16 rows; unused rows are masked)
# fp32 values of partial outputs one stage-2 load takes (8 warps above 4096): 8192 merges Gemma-2's 32 splits at batch 1
# (head_dim 256) in one round trip instead of two dependent ones
STAGE2_VALUES_PER_LOAD = 8192


def _decode_launch_configs(d: int, dv: int, device: torch.device, fp8_kv: bool = False) -> list[dict]:
    """Preferred first (measured on an H200: docs/benchmark_history.md, session 22 for the ROWS_AHEAD ones); later entries
    need less shared memory."""
    if device.type != "cuda":
        return [dict(BLOCK_N=16, num_warps=4, num_stages=1)]
    if max(d, dv) <= 128:
        fallbacks = [dict(BLOCK_N=64, num_warps=2, num_stages=2), dict(BLOCK_N=32, num_warps=2, num_stages=1)]
        # fp8 caches: double-buffered 64-key tiles, 4 programs an SM (Llama-3-8B, batch 8 at 8K: 1.02-1.04x the step)
        return [dict(BLOCK_N=64, num_warps=2, num_stages=3, ROWS_AHEAD=True)] + fallbacks if fp8_kv else fallbacks
    if max(d, dv) <= 256:
        # double-buffered 32-key tiles, 2 programs an SM (Gemma-2-9B at 8K: batch 8 1.018x the step, batch 1 1.005x)
        return [dict(BLOCK_N=32, num_warps=4, num_stages=3, ROWS_AHEAD=True),
                dict(BLOCK_N=64, num_warps=4, num_stages=2), dict(BLOCK_N=32, num_warps=4, num_stages=1)]
    return [dict(BLOCK_N=32, num_warps=8, num_stages=2), dict(BLOCK_N=16, num_warps=4, num_stages=1)]


def _decode_dot_dtype(q: torch.Tensor, k_buffer: torch.Tensor):
    dt = dot_dtype(q)
    if dt == tl.bfloat16 and k_buffer.dtype in FP8_DTYPES:
        # fp8 -> fp16 is one conversion instruction, fp8 -> bf16 is several: 25% faster at batch 64 on an
        # H200. fp8 values are exact in fp16; q is clamped to fp16's range first.
        return tl.float16
    return dt


def _stage_fp8_values(v_buffer: torch.Tensor, dot_dt) -> bool:
    """Whether stage 1 upcasts V tiles before their shared-memory staging (_upcast_before_staging): fp8 caches on the
    GPU (the interpreter dots in fp32 and runs no inline PTX)."""
    return dot_dt != tl.float32 and v_buffer.dtype in FP8_DTYPES


def decode_attention_fwd(
    q: torch.Tensor,  # [B, H, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, Dv]
    o: torch.Tensor,  # [B, H, Dv], written
    req_to_token: torch.Tensor,  # [R, C] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    attn_logits: torch.Tensor,  # [>=B, >=H, num_kv_splits, >=Dv+1] fp32 scratch
    num_kv_splits: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    sliding_window: int = -1,
    k_scale: float = 1.0,  # dequantisation scales of values read from k_buffer / v_buffer (fp8 caches)
    v_scale: float = 1.0,
    launch_config: Optional[dict] = None,  # stage 1's BLOCK_N, num_warps, num_stages[, ROWS_AHEAD]
) -> None:
    b, h, d = q.shape
    h_kv = k_buffer.shape[1]
    dv = v_buffer.shape[-1]
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({h_kv})")
    if k_buffer.shape[-1] != d or v_buffer.shape[1] != h_kv or o.shape != (b, h, dv):
        raise ValueError(f"inconsistent decode shapes: q {tuple(q.shape)}, k_buffer {tuple(k_buffer.shape)}, "
                         f"v_buffer {tuple(v_buffer.shape)}, o {tuple(o.shape)}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if (attn_logits.dtype != torch.float32 or attn_logits.dim() != 4 or attn_logits.shape[0] < b
            or attn_logits.shape[1] < h or attn_logits.shape[2] < num_kv_splits or attn_logits.shape[3] < dv + 1):
        raise ValueError(f"attn_logits must be fp32 [>={b}, >={h}, >={num_kv_splits}, >={dv + 1}], "
                         f"got {attn_logits.dtype} {tuple(attn_logits.shape)}")
    check_last_dim_contiguous(q=q, o=o, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token,
                              attn_logits=attn_logits)
    if b == 0:
        return

    group = h // h_kv
    head_blocks = triton.cdiv(group, _BLOCK_H)
    block_d, block_dpe = split_head_dim(d)
    block_dv = max(16, triton.next_power_of_2(dv))
    use_window = sliding_window > 0
    dot_dt = _decode_dot_dtype(q, k_buffer)
    launch_config = dict(launch_config or {})
    stage_v = bool(launch_config.pop("STAGE_V", _stage_fp8_values(v_buffer, dot_dt)))
    configs = [launch_config] if launch_config else _decode_launch_configs(d, dv, q.device,
                                                                           k_buffer.dtype in FP8_DTYPES)
    configs = [{"ROWS_AHEAD": False, **cfg} for cfg in configs]  # the kernel's constexprs have no defaults
    block_s = max(2, min(triton.next_power_of_2(num_kv_splits), STAGE2_VALUES_PER_LOAD // block_dv))
    key = ("decode", q.device, q.dtype, k_buffer.dtype, d, dv, stage_v, tuple(sorted(launch_config.items())))
    cfg = launch_first_fitting(
        _decode_stage1_kernel, lambda cfg: (b, h_kv * head_blocks, num_kv_splits), configs, key,
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, attn_logits,
        float(sm_scale * k_scale), float(logit_cap), int(sliding_window), int(num_kv_splits), float(v_scale),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        KV_GROUP=group, HEAD_BLOCKS=head_blocks, D=d, DV=dv,
        BLOCK_D=block_d, BLOCK_DPE=block_dpe, BLOCK_DV=block_dv, BLOCK_H=_BLOCK_H,
        USE_CAP=logit_cap > 0, USE_WINDOW=use_window, DOT_DTYPE=dot_dt,
        CLAMP_Q=dot_dt == tl.float16 and q.dtype == torch.bfloat16, STAGE_V=stage_v,
        **pdl.launch_options(q.device),
    )
    # stage 2 must split the keys exactly as stage 1 did: same BLOCK_N
    _decode_stage2_kernel[(b, h)](
        attn_logits, o, seq_lens, int(sliding_window), int(num_kv_splits),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2), o.stride(0), o.stride(1),
        DV=dv, BLOCK_DV=block_dv, BLOCK_N=cfg["BLOCK_N"], USE_WINDOW=use_window, BLOCK_S=block_s,
        num_warps=4 if block_s * block_dv <= 4096 else 8, num_stages=2, **pdl.launch_options(q.device),
    )
