"""The experts of a few tokens (decode batches) as two GEMV-style launches, without the expert sort.

At T <= SMALL_BATCH_MAX_TOKENS the grouped GEMM (fused_moe_kernels.py) pads every chosen expert's one or two rows to
a BLOCK_M = 16 tile and needs the sort launch before it; here every (token, slot) pair streams its expert's rows
directly, as the dense batch-1 GEMV (layers/gemv.py) streams a weight:

1. gate_up: program (pair, n) reads BLOCK_N gate rows and the matching up rows of expert ids[pair] (coalesced along
   H) against x[token], and writes act[pair, n-block] = silu(gate) * up. [T*S, I]
2. down: program (token, n) reads BLOCK_N rows of w2 for each of the token's S slots in turn and sums
   w2[e] . (weights[token, slot] * act[pair]) in fp32: the top-k weights and the sum over the slots happen inside
   the kernel, the output [T, H] is written once (no [T*S, H] intermediate, no separate sum).

S = top_k + shared experts (router.py appends the shared ones as always-chosen slots). Tokens that chose the same
expert re-read its rows, mostly from L2: programs of one row block are adjacent in launch order. Both kernels launch
with PDL (pdl.py): they start during the previous kernel's tail; the expert ids come from the router, so no weight
is read before the wait. Grids depend only on T: CUDA-graph capturable. Runs under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.moe.expert_inputs import check_expert_inputs
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["SMALL_BATCH_MAX_TOKENS", "GemvConfig", "small_batch_moe"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# up to this many tokens fused_experts takes these kernels on CUDA (benchmarks/gpu/moe_small_batch.sh times both
# paths at T = 1 .. 16 at DeepSeek-V2-Lite shapes)
SMALL_BATCH_MAX_TOKENS = 8


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows per program
    block_k: int  # columns per load
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if self.block_n < 1 or self.block_n & (self.block_n - 1) or self.block_k < 16 \
                or self.block_k & (self.block_k - 1):
            raise ValueError(f"GEMV config needs power-of-two block_n and block_k >= 16: {self}")


# autotuned per (shape, T) on first use, which the CUDA-graph runner's warm-up passes do before capture; the
# candidates are the dense GEMV's best shapes (4 rows x 1-2K columns per program) and neighbours, three each (every
# candidate compiles at start-up on the slow host). benchmarks/gpu/moe_small_batch.sh sweeps more at
# DeepSeek-V2-Lite shapes (H 2048, I 1408).
GATE_UP_CANDIDATES = (GemvConfig(4, 1024, 4, 3), GemvConfig(4, 2048, 4, 1), GemvConfig(8, 512, 4, 3))
# the down kernel has H / BLOCK_N programs per token (512 at BLOCK_N 4): fewer rows per program keep more SMs busy
DOWN_CANDIDATES = (GemvConfig(4, 512, 4, 3), GemvConfig(2, 512, 4, 3), GemvConfig(1, 512, 2, 4))
_INTERPRET_CONFIG = GemvConfig(4, 32, 1, 1)


def _autotune_configs(candidates: tuple[GemvConfig, ...]) -> list:
    chosen = (_INTERPRET_CONFIG,) if _INTERPRET else candidates
    return [triton.Config({"BLOCK_N": c.block_n, "BLOCK_K": c.block_k}, num_warps=c.num_warps,
                          num_stages=c.num_stages) for c in chosen]


@triton.jit
def _silu_mul_gemv_kernel(x_ptr, w13_ptr, scale_ptr, ids_ptr, act_ptr, num_tokens, N, K, x_stride, w_expert_stride,
                          w_row_stride, act_stride, SLOTS: tl.constexpr, W_SCALED: tl.constexpr,
                          EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # act[pair, n] = silu(x[pair // SLOTS] . w13[e, n]) * (x[pair // SLOTS] . w13[e, N + n]), e = ids[pair]
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    gate_rows = w13_ptr + expert * w_expert_stride + rows.to(tl.int64)[:, None] * w_row_stride
    up_rows = gate_rows + N.to(tl.int64) * w_row_stride
    x_row = x_ptr + (pair // SLOTS).to(tl.int64) * x_stride
    cols = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the gate and the up chunk of one iteration load together
        kk = k0 + cols
        if EVEN_K:
            x = tl.load(x_row + kk).to(tl.float32)
            w_mask = row_mask[:, None]
        else:
            x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
            w_mask = row_mask[:, None] & (kk < K)[None, :]
        g = tl.load(gate_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        u = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        acc_gate += g.to(tl.float32) * x[None, :]
        acc_up += u.to(tl.float32) * x[None, :]
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    if W_SCALED:  # e4m3 rows: their scales [E, 2N], gate rows then up rows
        scale_rows = scale_ptr + expert * 2 * N + rows
        gate = gate * tl.load(scale_rows, mask=row_mask, other=0.0)
        up = up * tl.load(scale_rows + N, mask=row_mask, other=0.0)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pair.to(tl.int64) * act_stride + rows, out.to(act_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _weighted_down_gemv_kernel(act_ptr, w2_ptr, scale_ptr, ids_ptr, weights_ptr, out_ptr, num_tokens, N, K, act_stride,
                               w_expert_stride, w_row_stride, out_stride, SLOTS: tl.constexpr,
                               W_SCALED: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[t, n] = sum_j weights[t, j] * (w2[ids[t, j], n] . act[t * SLOTS + j]), summed in fp32, stored once
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    row_offsets = rows.to(tl.int64)[:, None] * w_row_stride
    cols = tl.arange(0, BLOCK_K)
    chunks = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # one flat loop over (slot, K chunk): the loads of the next slot's rows pipeline behind this slot's
    for step in range(0, SLOTS * chunks):
        pair = token * SLOTS + step // chunks
        kk = (step % chunks) * BLOCK_K + cols
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        act_row = act_ptr + pair.to(tl.int64) * act_stride
        if EVEN_K:
            a = tl.load(act_row + kk).to(tl.float32)
            w_mask = row_mask[:, None]
        else:
            a = tl.load(act_row + kk, mask=kk < K, other=0.0).to(tl.float32)
            w_mask = row_mask[:, None] & (kk < K)[None, :]
        w = tl.load(w2_ptr + expert * w_expert_stride + row_offsets + kk[None, :], mask=w_mask, other=0.0,
                    eviction_policy="evict_first")
        w = w.to(tl.float32)
        if W_SCALED:  # e4m3 rows times this slot's expert's row scales [E, N]
            w = w * tl.load(scale_ptr + expert * N + rows, mask=row_mask, other=0.0)[:, None]
        acc += w * (a * tl.load(weights_ptr + pair))[None, :]
    total = tl.sum(acc, axis=1)
    tl.store(out_ptr + token.to(tl.int64) * out_stride + rows, total.to(out_ptr.dtype.element_ty), mask=row_mask)


def _autotuned(kernel, candidates):
    # num_tokens in the key: the grid, so the best shape, depends on it; EVEN_K follows each config's BLOCK_K
    return triton.autotune(configs=_autotune_configs(candidates),
                           key=["num_tokens", "N", "K", "SLOTS", "W_SCALED", "USE_PDL"])(
        triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(kernel))


_silu_mul_gemv_autotuned = _autotuned(_silu_mul_gemv_kernel, GATE_UP_CANDIDATES)
_weighted_down_gemv_autotuned = _autotuned(_weighted_down_gemv_kernel, DOWN_CANDIDATES)


def _launch(kernel, autotuned, programs: int, rows: int, k: int, config: Optional[GemvConfig], args: tuple,
            device: torch.device, slots: int, scaled: bool) -> None:
    # grid: (programs, the weight's `rows` in blocks of BLOCK_N); k: the dot length (the kernel's K)
    flags = dict(SLOTS=slots, W_SCALED=scaled, **pdl.launch_options(device))
    if config is None:
        autotuned[lambda meta: (programs, triton.cdiv(rows, meta["BLOCK_N"]))](*args, **flags)
    else:
        kernel[(programs, triton.cdiv(rows, config.block_n))](
            *args, **flags, EVEN_K=k % config.block_k == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages)


def small_batch_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str = "silu", gate_up_config: Optional[GemvConfig] = None,
                    down_config: Optional[GemvConfig] = None, w13_scale: Optional[torch.Tensor] = None,
                    w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, S], topk_ids [T, S] (int) -> [T, H] in
    hidden's dtype: sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]; fp8
    experts (e4m3 with fp32 row scales [E, 2I] / [E, H]) stream half the bytes. Two launches; configs given skip the
    autotuner (benchmarks sweep them)."""
    check_expert_inputs(hidden, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale)
    num_tokens, slots = topk_ids.shape
    _, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("the expert weights need unit stride along their last dim")
    hidden = hidden.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    act = torch.empty(num_tokens * slots, inter, dtype=hidden.dtype, device=hidden.device)  # [T*S, I]
    _launch(_silu_mul_gemv_kernel, _silu_mul_gemv_autotuned, num_tokens * slots, inter, hidden_size, gate_up_config,
            (hidden, w13, w13 if w13_scale is None else w13_scale, topk_ids, act, num_tokens, inter, hidden_size,
             hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0)), hidden.device, slots,
            w13_scale is not None)
    _launch(_weighted_down_gemv_kernel, _weighted_down_gemv_autotuned, num_tokens, hidden_size, inter, down_config,
            (act, w2, w2 if w2_scale is None else w2_scale, topk_ids, topk_weights, out, num_tokens, hidden_size, inter,
             act.stride(0), w2.stride(0), w2.stride(1), out.stride(0)), hidden.device, slots, w2_scale is not None)
    return out
