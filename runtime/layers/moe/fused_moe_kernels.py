"""The fused MoE on the GPU: (token, slot) pairs sorted by expert in blocks of BLOCK_M rows, then two grouped GEMMs.

1. `moe_align_block_size`: the T*k (token, slot) pairs, grouped by expert, each expert's run padded to a multiple of
   BLOCK_M; one expert id per block. A single-program kernel counts and pads (and places small batches); larger
   ones are placed by a second, parallel kernel through per-expert atomic cursors. No host sync.
2. gate_up GEMM with SiLU-and-mul in its epilogue: each program computes a [BLOCK_M, BLOCK_N] tile of both the gate
   and the up half of its expert's w13 and writes silu(gate) * up, [T*k, I].
3. down GEMM: [T*k, I] x w2[e]^T, each row scaled by its top-k weight, [T*k, H]; then the k rows of a token summed.

Every launch's grid depends only on T (programs past the padded end return at once), so the whole path is
CUDA-graph capturable. All GEMMs accumulate in fp32. Runs on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers.moe.expert_inputs import check_expert_inputs

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

__all__ = ["MoEKernelConfig", "H200_CONFIGS", "pick_config", "moe_align_block_size", "fused_moe_triton"]


@dataclass(frozen=True)
class MoEKernelConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1  # programs of GROUP_M consecutive row blocks sweep the columns together (L2 reuse of w)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MoE kernel {name} must be a power of two >= 16, got {value}")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"MoE kernel config invalid: {self}")


# Chosen by average rows per expert, T * k / E (the GEMMs' M per expert): the first row whose bound is >= it.
# Starting points, not yet measured on the H200: benchmarks/gpu/fused_moe_vs_torch.sh sweeps configs at
# DeepSeek-V2-Lite shapes (64 experts, top-6, H 2048, I 1408) and prints the rows to put here.
H200_CONFIGS: tuple[tuple[float, MoEKernelConfig], ...] = (
    (0.1, MoEKernelConfig(16, 32, 64, 1, 4, 4)),
    (3.0, MoEKernelConfig(16, 32, 128, 1, 4, 4)),
    (6.0, MoEKernelConfig(16, 64, 128, 1, 4, 4)),
    (24.0, MoEKernelConfig(64, 128, 64, 1, 4, 3)),
    (float("inf"), MoEKernelConfig(64, 128, 64, 8, 8, 3)),
)

ALIGN_COUNT_CHUNK = 4096  # ids per histogram step
ALIGN_PLACE_CHUNK = 128  # up to this many pairs are placed by the counting program itself (decode batches)


def pick_config(num_tokens: int, top_k: int, num_experts: int) -> MoEKernelConfig:
    rows_per_expert = num_tokens * top_k / num_experts
    return next(config for bound, config in H200_CONFIGS if rows_per_expert <= bound)


@triton.jit
def _expert_blocks(block_experts_ptr, padded_end, first_block, total, BLOCK_M: tl.constexpr,
                   BLOCK_CHUNK: tl.constexpr):
    # block b holds rows [b * BLOCK_M, (b + 1) * BLOCK_M): its expert is the number of experts ending at or before it
    blocks = first_block + tl.arange(0, BLOCK_CHUNK)
    expert = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
    tl.store(block_experts_ptr + blocks, expert, mask=blocks * BLOCK_M < total)


@triton.jit
def _align_counts_kernel(topk_ids_ptr, sorted_pairs_ptr, block_experts_ptr, padded_total_ptr, scratch_ptr, num_pairs,
                         NUM_EXPERTS: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr,
                         COUNT_CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr, PLACE_HERE: tl.constexpr,
                         PLACE_CHUNK: tl.constexpr):
    # one program: per-expert counts, padded extents, the padding rows; with PLACE_HERE (num_pairs <= PLACE_CHUNK)
    # also the pairs' rows and the block experts, else the row cursors and extents for _align_place_kernel
    bins = tl.arange(0, BINS)  # BINS > NUM_EXPERTS: bin NUM_EXPERTS collects the masked-off lanes
    counts = tl.zeros((BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, COUNT_CHUNK):
        offs = start + tl.arange(0, COUNT_CHUNK)
        counts += tl.histogram(tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=NUM_EXPERTS), BINS)
    counts = tl.where(bins < NUM_EXPERTS, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(padded_total_ptr, total)
    # rows [padded_start + count, padded_end) of an expert are padding: fewer than BLOCK_M of them
    pad_rows = (padded_start + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_pairs_ptr + pad_rows, num_pairs, mask=pad_rows < padded_end[:, None])
    if PLACE_HERE:
        # the pairs as one [PLACE_CHUNK, BINS] one-hot: a pair's row is its expert's start plus the number of
        # earlier pairs of that expert
        pairs = tl.arange(0, PLACE_CHUNK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        one_hot = (ids[:, None] == bins[None, :]).to(tl.int32)
        earlier_same = tl.cumsum(one_hot, axis=0) - one_hot
        row = tl.sum(one_hot * (earlier_same + padded_start[None, :]), axis=1)
        tl.store(sorted_pairs_ptr + row, pairs, mask=pairs < num_pairs)
        for first_block in range(0, total // BLOCK_M, BLOCK_CHUNK):
            _expert_blocks(block_experts_ptr, padded_end, first_block, total, BLOCK_M, BLOCK_CHUNK)
    else:
        tl.store(scratch_ptr + bins, padded_start)
        tl.store(scratch_ptr + BINS + bins, padded_end)


@triton.jit
def _align_place_kernel(topk_ids_ptr, sorted_pairs_ptr, block_experts_ptr, padded_total_ptr, scratch_ptr, num_pairs,
                        BINS: tl.constexpr, BLOCK_M: tl.constexpr, PLACE_CHUNK: tl.constexpr,
                        BLOCK_CHUNK: tl.constexpr):
    # program p: pairs [p * PLACE_CHUNK, ...) take rows from their expert's cursor (the order inside an expert's run
    # varies; each row's result does not depend on it), and blocks [p * BLOCK_CHUNK, ...) get their expert
    pid = tl.program_id(0)
    pairs = pid * PLACE_CHUNK + tl.arange(0, PLACE_CHUNK)
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=0)
    row = tl.atomic_add(scratch_ptr + ids, 1, mask=valid)
    tl.store(sorted_pairs_ptr + row, pairs, mask=valid)
    padded_end = tl.load(scratch_ptr + BINS + tl.arange(0, BINS))
    _expert_blocks(block_experts_ptr, padded_end, pid * BLOCK_CHUNK, tl.load(padded_total_ptr), BLOCK_M, BLOCK_CHUNK)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [P] int32, block_experts [P / block_m] int32, padded_total [1] int32).

    sorted_pairs lists the flat pair indices t * k + j grouped by expert, each expert's run padded with T * k (an
    out-of-range index the kernels skip) to a multiple of block_m; block_experts[b] is the expert of rows
    [b * block_m, (b + 1) * block_m); padded_total is where the used rows end, and entries past it are left
    unwritten. P = T*k + min(E, T*k) * (block_m - 1), the most padding can need, is fixed by T. Inside an expert's
    run the pairs ascend when T*k <= ALIGN_PLACE_CHUNK (one launch), else they come in any order (two launches).
    No host sync."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    num_pairs = ids.numel()
    capacity = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    device = ids.device
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    num_blocks = triton.cdiv(capacity, block_m)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    padded_total = torch.empty(1, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts + 1)
    place_here = num_pairs <= ALIGN_PLACE_CHUNK
    scratch = padded_total if place_here else torch.empty(2 * bins, dtype=torch.int32, device=device)
    block_chunk = max(16, 8192 // bins)
    _align_counts_kernel[(1,)](ids, sorted_pairs, block_experts, padded_total, scratch, num_pairs,
                               NUM_EXPERTS=num_experts, BINS=bins, BLOCK_M=block_m, COUNT_CHUNK=ALIGN_COUNT_CHUNK,
                               BLOCK_CHUNK=block_chunk, PLACE_HERE=place_here, PLACE_CHUNK=ALIGN_PLACE_CHUNK,
                               num_warps=8)
    if not place_here:
        grid = (max(triton.cdiv(num_pairs, ALIGN_PLACE_CHUNK), triton.cdiv(num_blocks, block_chunk)),)
        _align_place_kernel[grid](ids, sorted_pairs, block_experts, padded_total, scratch, num_pairs, BINS=bins,
                                  BLOCK_M=block_m, PLACE_CHUNK=ALIGN_PLACE_CHUNK, BLOCK_CHUNK=block_chunk,
                                  num_warps=4)
    return sorted_pairs, block_experts, padded_total


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, b_scale_ptr, c_ptr, topk_weights_ptr, sorted_pairs_ptr, block_experts_ptr,
                         padded_total_ptr, num_pairs, num_rows_padded, N, K,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         A_ROWS_PER_PAIR_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         B_SCALED: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # C[pair, n] = A[pair // A_ROWS_PER_PAIR_DIV, :] . B[expert(pair), n, :] for the rows of one expert block;
    # GATED: B holds [gate; up] (2N rows) and C = silu(gate) * up; MUL_WEIGHT: C *= topk_weights[pair];
    # B_SCALED: B is e4m3 with fp32 row scales [E, rows] (its tiles upcast to A's dtype for the dot)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_rows_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(padded_total_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROWS_PER_PAIR_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
            if FP32_DOT:
                acc_up = tl.dot(a.to(tl.float32), b_up.to(tl.float32), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up.to(a.dtype), acc_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if B_SCALED:
        if GATED:  # [E, 2N]: gate rows then up rows
            scale_row = b_scale_ptr + expert * 2 * N + offs_n
            acc_up = acc_up * tl.load(scale_row + N, mask=col_valid, other=0.0)[None, :]
        else:
            scale_row = b_scale_ptr + expert * N + offs_n
        acc = acc * tl.load(scale_row, mask=col_valid, other=0.0)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def _launch_grouped_gemm(a, b, c, topk_weights, sorted_pairs, block_experts, padded_total, num_pairs, *,
                         a_rows_per_pair_div: int, gated: bool, mul_weight: bool, config: MoEKernelConfig,
                         b_scale: Optional[torch.Tensor] = None) -> None:
    n_out, k_in = c.shape[1], a.shape[1]
    grid = (triton.cdiv(sorted_pairs.numel(), config.block_m) * triton.cdiv(n_out, config.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, b if b_scale is None else b_scale, c, topk_weights, sorted_pairs, block_experts, padded_total, num_pairs,
        sorted_pairs.numel(), n_out,
        k_in, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROWS_PER_PAIR_DIV=a_rows_per_pair_div, GATED=gated, MUL_WEIGHT=mul_weight, B_SCALED=b_scale is not None,
        # fp32 inputs multiply in full fp32 (not tf32); so do 16-bit ones under Triton's interpreter, which
        # multiplies them wrongly as they are
        FP32_DOT=a.dtype == torch.float32 or _INTERPRET, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str = "silu",
                     config: Optional[MoEKernelConfig] = None, w13_scale: Optional[torch.Tensor] = None,
                     w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k] -> [T, H] (hidden's dtype);
    fp8 experts: e4m3 w13 / w2 with fp32 row scales [E, 2I] / [E, H]. config: block sizes; by default picked from
    H200_CONFIGS by T * k / E."""
    check_expert_inputs(hidden, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    if num_tokens == 0:
        return torch.empty_like(hidden)
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    config = config or pick_config(num_tokens, top_k, num_experts)
    num_pairs = num_tokens * top_k
    sorted_pairs, block_experts, padded_total = moe_align_block_size(topk_ids, config.block_m, num_experts)
    weights = topk_weights.reshape(-1).float()
    if not weights.is_contiguous():
        weights = weights.contiguous()
    gated = torch.empty(num_pairs, two_inter // 2, dtype=hidden.dtype, device=hidden.device)  # [T*k, I]
    _launch_grouped_gemm(hidden, w13, gated, weights, sorted_pairs, block_experts, padded_total, num_pairs,
                         a_rows_per_pair_div=top_k, gated=True, mul_weight=False, config=config, b_scale=w13_scale)
    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)  # [T*k, H]
    _launch_grouped_gemm(gated, w2, per_pair, weights, sorted_pairs, block_experts, padded_total, num_pairs,
                         a_rows_per_pair_div=1, gated=False, mul_weight=True, config=config, b_scale=w2_scale)
    return per_pair.view(num_tokens, top_k, hidden_size).sum(dim=1)
