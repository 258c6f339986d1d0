"""Triton GEMV for decode at batch 1, with SiLU-and-mul (or Gemma's GELU-tanh-and-mul) after it fused in.

At batch 1 a decode step is a stream over the weights, and the SiLU-and-mul after gate_up_proj costs as much
as a few microseconds of weight streaming in launch latency alone. One kernel here does

    y[1, N] = act(x @ W[N(, +N), K]^T)

Every program owns BLOCK_N rows of W (coalesced along K) and keeps BLOCK_N x BLOCK_K partial products in
registers. An fp8 (e4m3) weight comes with one fp32 scale per row (the fp8 LinearMethod): products accumulate
in fp32 from the upcast weight and the unquantized x, and each row's sum is multiplied by its scale at the end
(weight-only dequantization: x is not rounded to fp8 at batch 1). With SiLU-and-mul fused, a program owns the gate rows n and the up rows n + N of a [2N, K] weight
and writes silu(gate) * up, rounding gate and up to the activation dtype where the unfused path
(activation.py) rounds them. (Fusing the RMSNorm before a projection as well measured slower on the H200:
every program then re-reads x and the residual from L2; see docs/benchmark_history.md.) Gemma's gelu_tanh_mul is the same
pairing with gelu(gate, tanh) rounded to the activation dtype before the product, as activation_kernels.py does.

With programmatic dependent launch (PDL, Hopper and later; see pdl.py), a GEMV is launched while the
kernel before it drains: every program loads its first weight chunk, which no earlier kernel writes, then
waits (griddepcontrol.wait) for the previous kernel's results before touching x. The weight stream thus
starts during the previous kernel's tail instead of after its completion and this launch's latency. Each
GEMV also signals its dependents as soon as it starts, so the GEMV after it can do the same.

With a LoRA adapter on the row (LoraEpilogue), each program adds the adapter's delta to its rows before the
activation or the rotary + KV-store epilogue, in place of the separate expand kernel: the adapter's B rows load
with the first weight chunk (no kernel of the step writes them), the shrink's partial sums after the wait.

Configs are autotuned per shape on first use, which the CUDA-graph runner's warm-up passes do before capture.
Runs on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import measured_tiles, pdl
from braid.runtime.layers.device_info import device_name
from braid.runtime.layers.activation_kernels import gelu_tanh
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["gemv", "gemv_rotary_store", "RotaryKVStore", "LoraEpilogue", "supports", "fp8_supports", "decode_gemv_applies", "enabled",
           "set_enabled"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_HALF_DTYPES = (torch.bfloat16, torch.float16)

# whether decode matmuls of 1..16 rows on CUDA go through this kernel and small_batch_gemm.py
# (ServerArgs.disable_decode_gemv)
_enabled = True


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> bool:
    """Route batch-1 bf16/fp16 CUDA matmuls through this kernel (or cuBLAS); returns the previous setting.
    Graphs captured before keep the kernels they captured."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def _configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=1)]
    # the best of a 44-config sweep per Llama-3-8B shape on an H200 (benchmarks/gpu/decode_b1.py), and neighbours
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((4, 2048, 4, 1), (4, 2048, 4, 3), (2, 1024, 4, 3), (4, 1024, 4, 3),
                                  (2, 2048, 4, 3), (8, 1024, 4, 1),
                                  # K that 1024 does not divide (Gemma-2-9B's 3584) streams unmasked in 512s
                                  (8, 512, 4, 3), (16, 512, 4, 3), (16, 512, 8, 3))]


@triton.jit
def _load_x_chunk(x_ptr, kk, k_mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        x = tl.load(x_ptr + kk).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _gemv_rows(rows, row_mask, pair_offset, x_ptr, w_ptr, K, w_row_stride, PAIRED: tl.constexpr,
               EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, WAIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """rows, row_mask: [R] -> (x . W[rows], x . W[rows + pair_offset] when PAIRED), each [R] fp32. WAIT: this
    program's first call, which waits for the previous kernel (PDL) after loading its first weight chunk."""
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_row_stride
    pair_rows = w_ptr + (rows.to(tl.int64) + pair_offset)[:, None] * w_row_stride
    # the first weight chunk: no earlier kernel writes W, so it streams before the wait for x
    if EVEN_K:
        w_mask0 = row_mask[:, None]
    else:
        w_mask0 = row_mask[:, None] & (cols < K)[None, :]
    w0 = tl.load(w_rows + cols[None, :], mask=w_mask0, other=0.0, eviction_policy="evict_first")
    u0 = w0
    if PAIRED:
        u0 = tl.load(pair_rows + cols[None, :], mask=w_mask0, other=0.0, eviction_policy="evict_first")
    if WAIT:
        wait_for_previous_kernel(USE_PDL)

    x0 = _load_x_chunk(x_ptr, cols, cols < K, EVEN_K)
    acc = w0.to(tl.float32) * x0[None, :]
    acc_pair = u0.to(tl.float32) * x0[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + cols
        k_mask = kk < K
        x = _load_x_chunk(x_ptr, kk, k_mask, EVEN_K)
        if EVEN_K:
            w_mask = row_mask[:, None]
        else:
            w_mask = row_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        if PAIRED:
            u = tl.load(pair_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc_pair += u.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1), tl.sum(acc_pair, axis=1)


@triton.jit
def _lora_b_rows(rows, row_mask, lb_ptr, lidx_ptr, lscale_ptr, L_R, l_stride_bn, l_stride_bo, LORA: tl.constexpr,
                 L_BLOCK_R: tl.constexpr):
    """rows [BLOCK] of a LoRA-carrying weight -> (B[slot][rows] [BLOCK, L_BLOCK_R] fp32, scale[slot]), slot = idx[0];
    zeros where slot < 0. Reads only what no kernel of the step writes (the adapter slots, the batch's index), so it
    runs before the wait for the previous kernel."""
    rk = tl.arange(0, L_BLOCK_R)
    if LORA:
        slot = tl.load(lidx_ptr)
        at = tl.maximum(slot, 0).to(tl.int64)
        cols_ok = (rk < L_R) & ((tl.zeros((L_BLOCK_R,), dtype=tl.int64) + slot) >= 0)  # none where slot < 0
        b = tl.load(lb_ptr + at * l_stride_bn + rows.to(tl.int64)[:, None] * l_stride_bo + rk[None, :],
                    mask=row_mask[:, None] & cols_ok[None, :], other=0.0).to(tl.float32)
        scale = tl.load(lscale_ptr + at).to(tl.float32)  # b is zero where slot < 0
    else:
        b = 0.0
        scale = 0.0
    return b, scale


@triton.jit
def _lora_row_delta(rows, b, scale, lh_ptr, L_R, L_P, L_S, l_stride_hp, l_off1, l_off2, L_BLOCK_R: tl.constexpr,
                    L_BLOCK_P: tl.constexpr):
    """The delta [BLOCK] fp32 of rows [BLOCK] with their B rows b [BLOCK, L_BLOCK_R]: scale * b . h[sub(row)], h_s
    the sum over the shrink's L_P partials [P, 1, L_S * L_R] of sub-matrix s's R values; rows from l_off1 on are
    sub-matrix 1, from l_off2 on 2. After the wait (the shrink kernel writes h)."""
    rk = tl.arange(0, L_BLOCK_R)
    pk = tl.arange(0, L_BLOCK_P)
    mask = (pk < L_P)[:, None] & (rk < L_R)[None, :]
    at = lh_ptr + pk[:, None] * l_stride_hp + rk[None, :]
    h0 = tl.sum(tl.load(at, mask=mask, other=0.0), axis=0)
    parts = tl.zeros((L_BLOCK_R,), dtype=tl.int32) + L_S  # [L_BLOCK_R] of L_S: the slices' masks as tensors
    h1 = tl.sum(tl.load(at + L_R, mask=mask & (parts > 1)[None, :], other=0.0), axis=0)
    h2 = tl.sum(tl.load(at + 2 * L_R, mask=mask & (parts > 2)[None, :], other=0.0), axis=0)
    sub = (rows >= l_off1).to(tl.int32) + (rows >= l_off2).to(tl.int32)
    h = tl.where((sub == 0)[:, None], h0[None, :], tl.where((sub == 1)[:, None], h1[None, :], h2[None, :]))
    return scale * tl.sum(b * h, axis=1)


@triton.jit
def _with_lora(y, rows, b, scale, lh_ptr, L_R, L_P, L_S, l_stride_hp, l_off1, l_off2, out_dtype: tl.constexpr,
               LORA: tl.constexpr, L_BLOCK_R: tl.constexpr, L_BLOCK_P: tl.constexpr):
    """y [BLOCK] fp32 sums -> with LORA, the unfused path's value: y rounded to out_dtype (the base output) plus the
    delta in fp32; else y as it is."""
    if LORA:
        y = y.to(out_dtype).to(tl.float32) + _lora_row_delta(rows, b, scale, lh_ptr, L_R, L_P, L_S, l_stride_hp,
                                                              l_off1, l_off2, L_BLOCK_R, L_BLOCK_P)
    return y


@triton.jit
def _gemv_row_block(block, x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, lh_ptr, lb_ptr, lscale_ptr,
                    lidx_ptr, L_R, L_P, L_S, l_stride_hp, l_stride_bn, l_stride_bo, l_off1, l_off2,
                    SILU_MUL: tl.constexpr, GELU_GATE: tl.constexpr, W_SCALED: tl.constexpr, EVEN_K: tl.constexpr,
                    USE_PDL: tl.constexpr, WAIT: tl.constexpr, LORA: tl.constexpr, L_BLOCK_R: tl.constexpr,
                    L_BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[rows of `block`]; with SILU_MUL the up row of each gate row n is row n + N. With LORA the adapter's delta
    joins each row before the activation (_with_lora)."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    b, scale = _lora_b_rows(rows, row_mask, lb_ptr, lidx_ptr, lscale_ptr, L_R, l_stride_bn, l_stride_bo, LORA,
                            L_BLOCK_R)
    b_up = 0.0
    if SILU_MUL:
        b_up, _ = _lora_b_rows(rows + N, row_mask, lb_ptr, lidx_ptr, lscale_ptr, L_R, l_stride_bn, l_stride_bo,
                               LORA, L_BLOCK_R)
    y, y_up = _gemv_rows(rows, row_mask, N, x_ptr, w_ptr, K, w_row_stride, SILU_MUL, EVEN_K, USE_PDL, WAIT,
                         BLOCK_K)
    if W_SCALED:  # w_scale: [rows] fp32, the up half's scales N entries further
        y = y * tl.load(w_scale_ptr + rows, mask=row_mask, other=0.0)
        if SILU_MUL:
            y_up = y_up * tl.load(w_scale_ptr + N + rows, mask=row_mask, other=0.0)
    y = _with_lora(y, rows, b, scale, lh_ptr, L_R, L_P, L_S, l_stride_hp, l_off1, l_off2, y_ptr.dtype.element_ty,
                   LORA, L_BLOCK_R, L_BLOCK_P)
    if SILU_MUL:
        y_up = _with_lora(y_up, rows + N, b_up, scale, lh_ptr, L_R, L_P, L_S, l_stride_hp, l_off1, l_off2,
                          y_ptr.dtype.element_ty, LORA, L_BLOCK_R, L_BLOCK_P)
    if SILU_MUL:  # the gated pair; GELU_GATE: gelu_tanh(gate) * up instead of silu(gate) * up
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = y_up.to(y_ptr.dtype.element_ty).to(tl.float32)
        if GELU_GATE:  # rounded before the product, as activation_kernels.gelu_and_mul does
            y = gelu_tanh(gate).to(y_ptr.dtype.element_ty).to(tl.float32) * up
        else:
            y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, num_programs, lh_ptr, lb_ptr, lscale_ptr,
                 lidx_ptr, L_R, L_P, L_S, l_stride_hp, l_stride_bn, l_stride_bo, l_off1, l_off2,
                 SILU_MUL: tl.constexpr, GELU_GATE: tl.constexpr, W_SCALED: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_PDL: tl.constexpr, LORA: tl.constexpr, L_BLOCK_R: tl.constexpr, L_BLOCK_P: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PERSISTENT: tl.constexpr):
    """One program per BLOCK_N rows; PERSISTENT: num_programs programs (the grid) take the row blocks in turn, so
    that all of them finish within one block of each other instead of the last wave running alone. Every launch
    passes every constexpr (none has a default): Inductor launches a kernel called inside a torch.compile region
    with the constexprs given at the call or by the autotune configs only, and a defaulted one it leaves out
    (TypeError: launcher() missing 1 required positional argument)."""
    pid = tl.program_id(0)
    let_next_kernel_launch(USE_PDL)
    _gemv_row_block(pid, x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, lh_ptr, lb_ptr, lscale_ptr, lidx_ptr,
                    L_R, L_P, L_S, l_stride_hp, l_stride_bn, l_stride_bo, l_off1, l_off2, SILU_MUL, GELU_GATE,
                    W_SCALED, EVEN_K, USE_PDL, True, LORA, L_BLOCK_R, L_BLOCK_P, BLOCK_N, BLOCK_K)
    if PERSISTENT:
        for block in range(pid + num_programs, tl.cdiv(N, BLOCK_N), num_programs):
            _gemv_row_block(block, x_ptr, w_ptr, w_scale_ptr, y_ptr, N, K, w_row_stride, lh_ptr, lb_ptr, lscale_ptr,
                            lidx_ptr, L_R, L_P, L_S, l_stride_hp, l_stride_bn, l_stride_bo, l_off1, l_off2, SILU_MUL,
                            GELU_GATE, W_SCALED, EVEN_K, USE_PDL, False, LORA, L_BLOCK_R, L_BLOCK_P, BLOCK_N,
                            BLOCK_K)


@triton.jit
def rotary_store_program(pid, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         V_WIDTH: tl.constexpr, BLOCK_N: tl.constexpr):
    """What program `pid` of a qkv GEMV with the rotary + KV-store epilogue owns (the grid rotary_store_args'
    programs(BLOCK_N) counts): the first programs BLOCK_N / 2 rows of a q or k head's first half and the rows
    HEAD_DIM / 2 further -> (True, head, pairs [BLOCK_N / 2] offsets in the first half, ...); the rest BLOCK_N rows of
    v -> (False, ..., v columns [BLOCK_N], their mask). The fields of the other kind are placeholders."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    PROGRAMS_PER_HEAD: tl.constexpr = HEAD_DIM // 2 // PAIRS
    qk_programs = (NUM_Q_HEADS + NUM_KV_HEADS) * PROGRAMS_PER_HEAD
    head = pid // PROGRAMS_PER_HEAD
    pairs = (pid % PROGRAMS_PER_HEAD) * PAIRS + tl.arange(0, PAIRS)
    v_cols = (pid - qk_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid < qk_programs, head, pairs, v_cols, v_cols < V_WIDTH


@triton.jit
def store_v_row(y, v_cols, v_mask, loc_ptr, v_cache_ptr, v_cache_stride, out_dtype: tl.constexpr):
    """The v columns v_cols [BLOCK_N] of the step's token (fp32 sums y) to v_cache[loc[0]] in out_dtype."""
    slot = tl.load(loc_ptr).to(tl.int64)
    tl.store(v_cache_ptr + slot * v_cache_stride + v_cols, y.to(out_dtype), mask=v_mask)


@triton.jit
def rotary_store_pair(y1, y2, head, pairs, q_ptr, pos_ptr, cos_sin_ptr, cos_sin_stride, loc_ptr, k_cache_ptr,
                      k_cache_stride, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The epilogue of a qkv GEMV's program that owns the rows `pairs` [P] of a q or k head's first half (y1: their
    fp32 sums) and the rows HEAD_DIM / 2 further (y2): rounded where the unfused GEMV's output is, rotated in fp32 as
    rotary_kernels does (neox pairs over the whole head), q to q_ptr, k to k_cache[loc[0]]."""
    HALF: tl.constexpr = HEAD_DIM // 2
    out_dtype = q_ptr.dtype.element_ty
    y1 = y1.to(out_dtype).to(tl.float32)
    y2 = y2.to(out_dtype).to(tl.float32)
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + pairs).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + pairs).to(tl.float32)
    o1 = (y1 * cos - y2 * sin).to(out_dtype)
    o2 = (y2 * cos + y1 * sin).to(out_dtype)
    if head < NUM_Q_HEADS:
        q_head = q_ptr + head * HEAD_DIM
        tl.store(q_head + pairs, o1)
        tl.store(q_head + HALF + pairs, o2)
    else:
        slot = tl.load(loc_ptr).to(tl.int64)
        k_head = k_cache_ptr + slot * k_cache_stride + (head - NUM_Q_HEADS) * HEAD_DIM
        tl.store(k_head + pairs, o1)
        tl.store(k_head + HALF + pairs, o2)


@triton.jit
def _gemv_rotary_store_kernel(x_ptr, w_ptr, q_ptr, pos_ptr, cos_sin_ptr, cos_sin_stride, loc_ptr, k_cache_ptr,
                              v_cache_ptr, k_cache_stride, v_cache_stride, K, w_row_stride, lh_ptr, lb_ptr,
                              lscale_ptr, lidx_ptr, L_R, L_P, L_S, l_stride_hp, l_stride_bn, l_stride_bo, l_off1,
                              l_off2, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              V_WIDTH: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                              LORA: tl.constexpr, L_BLOCK_R: tl.constexpr, L_BLOCK_P: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The qkv projection of one token with rotary and the KV write as its epilogue. The first programs each own
    BLOCK_N / 2 rows of a q or k head's first half and the rows HEAD_DIM / 2 further that they rotate with: q goes to
    q_ptr, k to k_cache[loc[0]]. The rest own BLOCK_N rows of v each, which go to v_cache[loc[0]]."""
    let_next_kernel_launch(USE_PDL)
    is_qk, head, pairs, v_cols, v_mask = rotary_store_program(tl.program_id(0), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                                              V_WIDTH, BLOCK_N)
    if is_qk:
        qk_rows = head * HEAD_DIM + pairs  # names apart from the v branch's: a runtime branch's types must agree
        every = qk_rows >= 0
        b1, qk_scale = _lora_b_rows(qk_rows, every, lb_ptr, lidx_ptr, lscale_ptr, L_R, l_stride_bn, l_stride_bo, LORA,
                                 L_BLOCK_R)
        b2, b2_scale = _lora_b_rows(qk_rows + HEAD_DIM // 2, every, lb_ptr, lidx_ptr, lscale_ptr, L_R, l_stride_bn,
                             l_stride_bo, LORA, L_BLOCK_R)
        y1, y2 = _gemv_rows(qk_rows, every, HEAD_DIM // 2, x_ptr, w_ptr, K, w_row_stride, True, EVEN_K, USE_PDL,
                            True, BLOCK_K)
        y1 = _with_lora(y1, qk_rows, b1, qk_scale, lh_ptr, L_R, L_P, L_S, l_stride_hp, l_off1, l_off2,
                        q_ptr.dtype.element_ty, LORA, L_BLOCK_R, L_BLOCK_P)
        y2 = _with_lora(y2, qk_rows + HEAD_DIM // 2, b2, b2_scale, lh_ptr, L_R, L_P, L_S, l_stride_hp, l_off1, l_off2,
                        q_ptr.dtype.element_ty, LORA, L_BLOCK_R, L_BLOCK_P)
        rotary_store_pair(y1, y2, head, pairs, q_ptr, pos_ptr, cos_sin_ptr, cos_sin_stride, loc_ptr, k_cache_ptr,
                          k_cache_stride, NUM_Q_HEADS, HEAD_DIM)
    else:
        v_rows = (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM + v_cols
        b, v_scale = _lora_b_rows(v_rows, v_mask, lb_ptr, lidx_ptr, lscale_ptr, L_R, l_stride_bn, l_stride_bo, LORA,
                                L_BLOCK_R)
        y, _ = _gemv_rows(v_rows, v_mask, 0, x_ptr, w_ptr, K, w_row_stride, False, EVEN_K, USE_PDL, True, BLOCK_K)
        y = _with_lora(y, v_rows, b, v_scale, lh_ptr, L_R, L_P, L_S, l_stride_hp, l_off1, l_off2, q_ptr.dtype.element_ty,
                       LORA, L_BLOCK_R, L_BLOCK_P)
        store_v_row(y, v_cols, v_mask, loc_ptr, v_cache_ptr, v_cache_stride, q_ptr.dtype.element_ty)


# measured_tiles.GEMV_CONFIGS, the tuples measured_config turns into gemv's `config`: (BLOCK_N, BLOCK_K, num_warps,
# num_stages[, PROGRAMS]) per GPU name and (weight rows, K, fused activation). Shapes not listed are autotuned.
MEASURED_CONFIGS = measured_tiles.GEMV_CONFIGS


def measured_table(tables: dict, device: torch.device) -> dict:
    """The entry of a {GPU name: {shape key: config}} table of measured kernel configs for `device` ({} for none,
    for CPU tensors and under the interpreter)."""
    if _INTERPRET or device.type != "cuda":
        return {}
    return tables.get(device_name(device), {})


def measured_config(device: torch.device, rows: int, k: int, activation: str) -> Optional[dict]:
    """The MEASURED_CONFIGS entry for this CUDA device's name and a [rows, K] weight with `activation` ("", "silu",
    "gelu") fused, as gemv's `config`, or None."""
    found = measured_table(MEASURED_CONFIGS, device).get((rows, k, activation))
    if found is None:
        return None
    bn, bk, warps, stages, *programs = found
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                **({"PROGRAMS": programs[0]} if programs else {}))


_EVEN_K_PER_CONFIG = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
_gemv_autotuned = triton.autotune(configs=_configs(), key=["N", "K", "SILU_MUL", "GELU_GATE", "USE_PDL", "LORA"])(
    _EVEN_K_PER_CONFIG(_gemv_kernel))


def _fp8_configs():
    if _INTERPRET:
        return _configs()
    # an fp8 row is half the bytes of a bf16 one: the same byte-sized chunks hold twice the columns
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((4, 4096, 4, 1), (4, 4096, 4, 3), (2, 4096, 4, 3), (8, 2048, 4, 3))]


# EVEN_K per config: Llama-3-8B's down projection (K = 14336) divides by 2048 but not by 4096
_gemv_fp8_autotuned = triton.autotune(configs=_fp8_configs(), key=["N", "K", "SILU_MUL", "GELU_GATE", "USE_PDL"])(
    _EVEN_K_PER_CONFIG(_gemv_kernel))


_gemv_rotary_store_autotuned = triton.autotune(
    configs=_configs(), key=["K", "NUM_Q_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "V_WIDTH", "USE_PDL", "LORA"])(
    _EVEN_K_PER_CONFIG(_gemv_rotary_store_kernel))


@dataclass(frozen=True)
class RotaryKVStore:
    """The epilogue of a decode step's qkv projection, given to its Linear as `act`: rotate q and k, write k and v
    to the layer's KV cache, and return q [T, H*D], rotated. Called on a matmul's output [T, H*D + Hkv*D + Hkv*Dv] it
    does so through `unfused` (q, k, v views -> rotated q; the pool's rotate_and_set_kv); the batch-1 GEMV does it
    in its own epilogue (gemv_rotary_store) where `target` names the cache to write."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    positions: torch.Tensor  # [T]
    rotary: object  # a RotaryEmbedding (rotary_dim, is_neox_style, cos_sin_cache [max_pos, rotary_dim])
    # -> (K cache [S, Hkv, D], V cache [S, Hkv, Dv], the tokens' slots there [T]), or None where only `unfused` may
    # write (an fp8 cache)
    target: Callable[[], Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
    unfused: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.v_head_dim], dim=-1)
        return self.unfused(q, k, v)


@dataclass(frozen=True)
class LoraEpilogue:
    """A LoRA adapter's delta for a batch-1 GEMV to add to its rows before its epilogue, in place of the expand
    kernel: row r gets scale[slot] * B[slot, r] . h_s, slot = idx[0] (-1: none), s the sub-matrix of row r (rows
    from offsets[0] on are sub-matrix 1, from offsets[1] on 2; qkv and gate_up stack theirs).
    h: the shrink's fp32 partial sums [P, 1, S * R] (summed over P: h_0 .. h_{S-1}, R values each); b: [N, rows, R],
    every sub-matrix's B stacked along rows; scale: [N]; idx: [1] int64."""

    h: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    idx: torch.Tensor
    offsets: tuple[int, int]

    def launch_args(self) -> tuple[tuple, dict]:
        """(the kernels' lh_ptr .. l_off2 arguments, their LORA constexprs)."""
        h, b = self.h, self.b
        rank, parts = b.shape[2], h.shape[2] // b.shape[2]
        return ((h, b, self.scale, self.idx, rank, h.shape[0], parts, h.stride(0), b.stride(0), b.stride(1),
                 *self.offsets),
                dict(LORA=True, L_BLOCK_R=max(16, triton.next_power_of_2(rank)),
                     L_BLOCK_P=triton.next_power_of_2(h.shape[0])))


def _lora_launch_args(lora: Optional[LoraEpilogue], x: torch.Tensor) -> tuple[tuple, dict]:
    """The kernels' LoRA arguments: lora's, or placeholders (never read) with LORA off."""
    if lora is None:
        return (x, x, x, x, 0, 0, 0, 0, 0, 0, 0, 0), dict(LORA=False, L_BLOCK_R=16, L_BLOCK_P=1)
    if lora.h.shape[1] != 1 or lora.idx.numel() != 1:
        raise ValueError(f"a GEMV's LoRA epilogue takes one row, got h {tuple(lora.h.shape)}, idx "
                         f"{tuple(lora.idx.shape)}")
    return lora.launch_args()


def rotary_store_args(x: torch.Tensor, weight: torch.Tensor, epilogue: RotaryKVStore) -> Optional[tuple]:
    """What a batch-1 qkv GEMV with the rotary + KV-store epilogue launches with, or None where it does not apply:
    rotary over part of a head or in interleaved pairs, no cache target, a cache in another dtype than x. -> (q [1, H*D]
    to fill, the kernel's arguments from x_ptr to w_row_stride less the weight's scales, its shape constexprs,
    programs(block_n) -> grid size). A program's BLOCK_N / 2 pairs must divide a half head: the caller's check."""
    rotary = epilogue.rotary
    h, h_kv, d, dv = epilogue.num_heads, epilogue.num_kv_heads, epilogue.head_dim, epilogue.v_head_dim
    cos_sin = getattr(rotary, "cos_sin_cache", None)
    if (x.dim() != 2 or x.shape[0] != 1 or weight.shape[0] != (h + h_kv) * d + h_kv * dv
            or epilogue.positions.numel() != 1 or not rotary.is_neox_style or rotary.rotary_dim != d or cos_sin is None
            or cos_sin.device != x.device or cos_sin.dim() != 2 or cos_sin.shape[1] != d or cos_sin.stride(1) != 1):
        return None
    target = epilogue.target()
    if target is None:
        return None
    k_cache, v_cache, loc = target
    if (k_cache.dtype != x.dtype or v_cache.dtype != x.dtype or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.shape[1:] != (h_kv, d) or v_cache[0].numel() != h_kv * dv
            or loc.numel() != 1 or loc.device != x.device):
        return None
    q = torch.empty((1, h * d), dtype=x.dtype, device=x.device)
    args = (x.contiguous(), weight, q, epilogue.positions, cos_sin, cos_sin.stride(0), loc, k_cache, v_cache,
            k_cache.stride(0), v_cache.stride(0), weight.shape[1], weight.stride(0))
    shape = dict(NUM_Q_HEADS=h, NUM_KV_HEADS=h_kv, HEAD_DIM=d, V_WIDTH=h_kv * dv, **pdl.launch_options(x.device))

    def programs(block_n: int) -> int:
        return (h + h_kv) * (d // block_n) + triton.cdiv(h_kv * dv, block_n)  # pairs of half heads, then v rows

    return q, args, shape, programs


def gemv_rotary_store(x: torch.Tensor, weight: torch.Tensor, epilogue: RotaryKVStore,
                      config: Optional[dict] = None, lora: Optional[LoraEpilogue] = None) -> Optional[torch.Tensor]:
    """x: [1, K]; weight: the qkv projection [H*D + Hkv*D + Hkv*Dv, K] -> q [1, H*D], rotated, with the rotated k and
    v written to the cache `epilogue.target()` names: the projection, rotary and the KV write in one launch. None
    (nothing done) where the kernel does not apply (rotary_store_args; a head dim that is no multiple of 16 for the
    autotuner, whose configs take up to 8 pairs a program). `config` (BLOCK_N, BLOCK_K, num_warps, num_stages) skips
    the autotuner. lora: an adapter's delta added to q, k and v before the rotation and the write."""
    d = epilogue.head_dim
    found = rotary_store_args(x, weight, epilogue) if supports(x, weight) and (config or d % 16 == 0) else None
    if found is None:
        return None
    q, args, shape, programs = found
    lora_args, lora_flags = _lora_launch_args(lora, x)
    args, shape = (*args, *lora_args), {**shape, **lora_flags}
    if config is None:
        _gemv_rotary_store_autotuned[lambda meta: (programs(meta["BLOCK_N"]),)](*args, **shape)
    else:
        cfg = dict(config)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        if cfg["BLOCK_N"] < 2 or (d // 2) % (cfg["BLOCK_N"] // 2):
            raise ValueError(f"BLOCK_N {cfg['BLOCK_N']} must be even with BLOCK_N / 2 dividing {d // 2}")
        k = weight.shape[1]
        _gemv_rotary_store_kernel[(programs(cfg["BLOCK_N"]),)](*args, **shape, EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg,
                                                               **launch)
    return q


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when gemv(x, weight) applies: one row of x, a 2-D weight with unit stride along K, same dtype."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.dtype == weight.dtype and weight.stride(1) == 1 and x.device == weight.device)


def decode_gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether the runtime routes this matmul here: enabled, batch-1 bf16/fp16 on CUDA without a bias."""
    return _enabled and bias is None and x.is_cuda and x.dtype in _HALF_DTYPES and supports(x, weight)


def fp8_supports(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """True when gemv(x, weight, weight_scale=...) applies: x [1, K] bf16/fp16, an e4m3 weight [N, K] with unit
    stride along K and a contiguous fp32 scale per row, all on one device."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.dtype in _HALF_DTYPES and weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1
            and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
            and weight_scale.numel() == weight.shape[0] and x.device == weight.device == weight_scale.device)


def gemv(x: torch.Tensor, weight: torch.Tensor, *, silu_mul: bool = False, gelu_tanh_mul: bool = False,
         config: Optional[dict] = None, weight_scale: Optional[torch.Tensor] = None,
         lora: Optional[LoraEpilogue] = None) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] (or [2N, K] = [gate; up] with silu_mul or gelu_tanh_mul) -> y [1, N].

    With silu_mul: y = silu(x @ Wg^T) * (x @ Wu^T); with gelu_tanh_mul: gelu(x @ Wg^T, tanh) * (x @ Wu^T), the
    activation rounded to x's dtype before the product. `config` (BLOCK_N, BLOCK_K, num_warps, num_stages, and
    optionally PROGRAMS: a persistent grid of that many programs) skips the autotuner (benchmarks sweep configs with
    it). weight_scale: an fp8 e4m3 weight's fp32 scale per row
    [N] (or [2N]); W is then weight * weight_scale[:, None], upcast to fp32, and x stays in its own dtype (the
    reference fp8 kernel; the runtime's fp8 batch-1 path is quantization/fp8_gemv.fp8_gemv). lora: an adapter's
    delta added to each row before the activation (not with weight_scale)."""
    if weight_scale is not None:
        if not fp8_supports(x, weight, weight_scale):
            raise ValueError(f"fp8 gemv needs x [1, K] bf16/fp16, an e4m3 weight [N, K] and an fp32 scale [N], got "
                             f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype}, "
                             f"{tuple(weight_scale.shape)} {weight_scale.dtype}")
    elif not supports(x, weight):
        raise ValueError(f"gemv needs x [1, K] and weight [N, K] of one dtype and device, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    rows, k = weight.shape
    if silu_mul and gelu_tanh_mul:
        raise ValueError("gemv takes one gated activation: silu_mul or gelu_tanh_mul")
    gated = silu_mul or gelu_tanh_mul
    if gated and rows % 2:
        raise ValueError(f"silu_mul / gelu_tanh_mul need a [2N, K] weight, got {rows} rows")
    n = rows // 2 if gated else rows
    x = x.contiguous()
    if config is None and weight_scale is None:
        config = measured_config(x.device, rows, k, "gelu" if gelu_tanh_mul else "silu" if silu_mul else "")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    scaled = weight_scale is not None
    if scaled and lora is not None:
        raise ValueError("gemv takes a LoRA epilogue on a dense weight only, not with weight_scale")
    args = (x, weight, weight_scale if scaled else weight, y, n, k, weight.stride(0))
    lora_args, lora_flags = _lora_launch_args(lora, x)
    flags = dict(SILU_MUL=bool(gated), GELU_GATE=bool(gelu_tanh_mul), W_SCALED=scaled,
                 **pdl.launch_options(x.device), **lora_flags)
    if config is None:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        # one program per row block: num_programs 0 is unused without PERSISTENT
        if scaled:
            _gemv_fp8_autotuned[grid](*args, 0, *lora_args, **flags, PERSISTENT=False)
        else:
            _gemv_autotuned[grid](*args, 0, *lora_args, **flags, PERSISTENT=False)
    else:
        cfg = dict(config)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        blocks = triton.cdiv(n, cfg["BLOCK_N"])
        # PROGRAMS: a persistent grid of that many programs (fewer when there are fewer row blocks)
        programs = min(blocks, cfg.pop("PROGRAMS", 0) or blocks)
        _gemv_kernel[(programs,)](*args, programs, *lora_args, **flags, EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg,
                                  PERSISTENT=programs < blocks, **launch)
    return y
