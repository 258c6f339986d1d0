"""Expert selection in Triton: softmax over the router logits, the group limit, top-k, renormalization and
routed_scaling_factor in one launch (router.py's PyTorch path does the same in 3 to 9 launches, which at decode batch
sizes cost more than the work), the shared experts appended as always-chosen slots (see layer.py).

Two entry points:
- `route_topk_triton(logits)`: logits computed before (any T). Each program routes BLOCK_T tokens with all E scores
  in registers; the k experts are taken by repeated arg-max (the lowest expert id wins a tie).
- `route_tokens_small_batch(hidden, gate_weight)`: for a few tokens (decode), the router matmul itself too, and
  optionally the add-RMSNorm before the MoE, so the whole router is one launch instead of four (the norm,
  hidden.float(), the fp32 GEMM, the routing). Programs (expert block, token) each hold the token's whole row and
  write BLOCK_E fp32 logits to a scratch row, then count themselves on a global counter; the program that arrives
  last routes every token (the "last block" reduction: its acquire on the counter orders it after the others'
  logit stores) and resets the counter for the next launch. No host sync, CUDA-graph capturable.

Runs on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel
from braid.runtime.loader.config_specs import MoESpec

__all__ = ["route_topk_triton", "route_tokens_small_batch", "small_batch_router_applies"]

# up to this many tokens route through route_tokens_small_batch (its last program routes them all alone), of hidden
# sizes up to SMALL_BATCH_ROUTER_MAX_HIDDEN (each program holds a whole row)
SMALL_BATCH_ROUTER_MAX_TOKENS = 16
SMALL_BATCH_ROUTER_MAX_HIDDEN = 8192


@triton.jit
def _route_rows(logits_ptr, weights_ptr, ids_ptr, rows, num_tokens, logits_stride, scaling,
                NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, TOP_K: tl.constexpr,
                SLOTS_POW2: tl.constexpr, NUM_SHARED: tl.constexpr, GROUP_LIMITED: tl.constexpr,
                NUM_GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_SIZE: tl.constexpr,
                TOPK_GROUPS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                VOLATILE: tl.constexpr):
    # rows [BLOCK_T]: routes these tokens' logits into TOP_K + NUM_SHARED slots per token
    row_valid = rows < num_tokens
    experts = tl.arange(0, EXPERTS_POW2)
    expert_valid = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + experts[None, :],
                     mask=row_valid[:, None] & expert_valid[None, :], other=float("-inf"),
                     volatile=VOLATILE).to(tl.float32)
    logits = tl.where(row_valid[:, None], logits, 0.0)  # rows past T: finite, never stored
    shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    scores = shifted / tl.sum(shifted, axis=1)[:, None]  # [BLOCK_T, EXPERTS_POW2]; 0 past NUM_EXPERTS
    if GROUP_LIMITED:
        # a group's score is its best expert's; the experts of all but the TOPK_GROUPS best groups score 0
        expert_group = experts // GROUP_SIZE
        groups = tl.arange(0, GROUPS_POW2)
        group_scores = tl.full((BLOCK_T, GROUPS_POW2), -1.0, tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            best_in_group = tl.max(tl.where(expert_group[None, :] == g, scores, -1.0), axis=1)
            group_scores = tl.where(groups[None, :] == g, best_in_group[:, None], group_scores)
        keep = tl.zeros((BLOCK_T, EXPERTS_POW2), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(group_scores, axis=1)
            chosen = tl.min(tl.where(group_scores == best[:, None], groups[None, :], GROUPS_POW2), axis=1)
            keep = keep | (expert_group[None, :] == chosen[:, None])
            group_scores = tl.where(groups[None, :] == chosen[:, None], -2.0, group_scores)
        scores = tl.where(keep, scores, 0.0)
    scores = tl.where(expert_valid[None, :], scores, -1.0)
    slots = tl.arange(0, SLOTS_POW2)
    top_weights = tl.zeros((BLOCK_T, SLOTS_POW2), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, SLOTS_POW2), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=1)
        chosen = tl.min(tl.where(scores == best[:, None], experts[None, :], EXPERTS_POW2), axis=1)
        top_weights = tl.where(slots[None, :] == j, best[:, None], top_weights)
        top_ids = tl.where(slots[None, :] == j, chosen[:, None], top_ids)
        scores = tl.where(experts[None, :] == chosen[:, None], -2.0, scores)
    if RENORMALIZE:
        top_weights = top_weights / (tl.sum(top_weights, axis=1)[:, None] + 1e-20)
    top_weights = top_weights * scaling
    # the shared experts: slots TOP_K + s hold expert NUM_EXPERTS + s with weight 1
    shared_slot = (slots >= TOP_K)[None, :]
    top_weights = tl.where(shared_slot, 1.0, top_weights)
    top_ids = tl.where(shared_slot, NUM_EXPERTS - TOP_K + slots[None, :], top_ids)
    out_offsets = rows.to(tl.int64)[:, None] * (TOP_K + NUM_SHARED) + slots[None, :]
    out_mask = row_valid[:, None] & (slots[None, :] < TOP_K + NUM_SHARED)
    tl.store(weights_ptr + out_offsets, top_weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, top_ids, mask=out_mask)


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, logits_stride, scaling,
                       NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, TOP_K: tl.constexpr,
                       SLOTS_POW2: tl.constexpr, NUM_SHARED: tl.constexpr, GROUP_LIMITED: tl.constexpr,
                       NUM_GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_SIZE: tl.constexpr,
                       TOPK_GROUPS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_rows(logits_ptr, weights_ptr, ids_ptr, rows, num_tokens, logits_stride, scaling, NUM_EXPERTS,
                EXPERTS_POW2, TOP_K, SLOTS_POW2, NUM_SHARED, GROUP_LIMITED, NUM_GROUPS, GROUPS_POW2, GROUP_SIZE,
                TOPK_GROUPS, RENORMALIZE, BLOCK_T, False)


@triton.jit
def _router_small_batch_kernel(x_ptr, res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, gate_ptr, logits_ptr, counter_ptr,
                               weights_ptr, ids_ptr, num_tokens, hidden_size, x_stride, res_stride, normed_stride,
                               res_out_stride, eps, scaling,
                               NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, TOP_K: tl.constexpr,
                               SLOTS_POW2: tl.constexpr, NUM_SHARED: tl.constexpr, GROUP_LIMITED: tl.constexpr,
                               NUM_GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_SIZE: tl.constexpr,
                               TOPK_GROUPS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                               BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ADD_NORM: tl.constexpr,
                               USE_PDL: tl.constexpr):
    # program (e, t): logits[t, e * BLOCK_E + i] = x[t] . gate[e * BLOCK_E + i] in fp32, x read whole (one tile).
    # ADD_NORM: x = rmsnorm(x + residual) first, rounded as norm_kernels.fused_add_rmsnorm rounds it (the sum, then
    # the normed row, to x's dtype); programs e == 0 also write both rows out for the experts and the next layer
    let_next_kernel_launch(USE_PDL)
    pid_e = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    experts = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    expert_valid = experts < NUM_EXPERTS
    cols = tl.arange(0, BLOCK_H)
    col_valid = cols < hidden_size
    # the program's whole gate tile: no kernel of the step writes the gate weight, so it loads before the wait
    w = tl.load(gate_ptr + experts.to(tl.int64)[:, None] * hidden_size + cols[None, :],
                mask=expert_valid[:, None] & col_valid[None, :], other=0.0)
    wait_for_previous_kernel(USE_PDL)
    x = tl.load(x_ptr + token * x_stride + cols, mask=col_valid, other=0.0)
    if ADD_NORM:
        summed = (x.to(tl.float32) + tl.load(res_ptr + token * res_stride + cols, mask=col_valid,
                                             other=0.0).to(tl.float32)).to(x.dtype)
        sf = summed.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / hidden_size + eps)
        x = (sf * rstd * tl.load(norm_w_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)).to(summed.dtype)
        if pid_e == 0:
            tl.store(res_out_ptr + token * res_out_stride + cols, summed, mask=col_valid)
            tl.store(normed_ptr + token * normed_stride + cols, x, mask=col_valid)
    logits = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + token * EXPERTS_POW2 + experts, logits, mask=expert_valid)
    # every thread's store is issued before the release below (CTA barrier, then one gpu-scope acq_rel atomic)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        # the last program: every logit is written; route all tokens, then reset the counter for the next launch
        for first in range(0, num_tokens, BLOCK_T):
            _route_rows(logits_ptr, weights_ptr, ids_ptr, first + tl.arange(0, BLOCK_T), num_tokens, EXPERTS_POW2,
                        scaling, NUM_EXPERTS, EXPERTS_POW2, TOP_K, SLOTS_POW2, NUM_SHARED, GROUP_LIMITED,
                        NUM_GROUPS, GROUPS_POW2, GROUP_SIZE, TOPK_GROUPS, RENORMALIZE, BLOCK_T, True)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def _routing_constants(spec: MoESpec, num_shared: int) -> dict:
    num_experts, top_k = spec.n_routed_experts, spec.num_experts_per_tok
    group_limited = spec.topk_method == "group_limited_greedy"
    num_groups = spec.n_group if group_limited else 1
    return dict(NUM_EXPERTS=num_experts, EXPERTS_POW2=triton.next_power_of_2(num_experts), TOP_K=top_k,
                SLOTS_POW2=triton.next_power_of_2(top_k + num_shared), NUM_SHARED=num_shared,
                GROUP_LIMITED=group_limited, NUM_GROUPS=num_groups, GROUPS_POW2=triton.next_power_of_2(num_groups),
                GROUP_SIZE=num_experts // num_groups, TOPK_GROUPS=spec.topk_group if group_limited else 1,
                RENORMALIZE=spec.norm_topk_prob)


def _route_outputs(num_tokens: int, slots: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(num_tokens, slots, dtype=torch.float32, device=device),
            torch.empty(num_tokens, slots, dtype=torch.int32, device=device))


def _unit_column_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def _block_t(experts_pow2: int) -> int:
    return max(1, min(16, 2048 // experts_pow2))


def route_topk_triton(router_logits: torch.Tensor, spec: MoESpec,
                      num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (fp32) -> (topk_weights [T, k + S] fp32, topk_ids [T, k + S] int32): the k routed
    experts by falling score, then the S = num_shared shared experts (ids E .. E + S - 1, weight 1)."""
    num_tokens = router_logits.shape[0]
    weights, ids = _route_outputs(num_tokens, spec.num_experts_per_tok + num_shared, router_logits.device)
    if num_tokens == 0:
        return weights, ids
    router_logits = _unit_column_stride(router_logits)
    constants = _routing_constants(spec, num_shared)
    block_t = _block_t(constants["EXPERTS_POW2"])
    _route_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_tokens, router_logits.stride(0), float(spec.routed_scaling_factor),
        **constants, BLOCK_T=block_t, num_warps=4)
    return weights, ids


_arrival_counters: dict[torch.device, torch.Tensor] = {}


def _arrival_counter(device: torch.device) -> torch.Tensor:
    # one int32 per device, zero between launches (the last program resets it); launches on one stream never overlap
    counter = _arrival_counters.get(device)
    if counter is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("route_tokens_small_batch: run it once before CUDA-graph capture (its counter is "
                               "allocated on first use)")
        counter = _arrival_counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def small_batch_router_applies(hidden: torch.Tensor) -> bool:
    """Whether route_tokens_small_batch takes this input: up to SMALL_BATCH_ROUTER_MAX_TOKENS rows of at most
    SMALL_BATCH_ROUTER_MAX_HIDDEN (each program holds a whole row)."""
    return hidden.dim() == 2 and hidden.shape[0] <= SMALL_BATCH_ROUTER_MAX_TOKENS \
        and hidden.shape[1] <= SMALL_BATCH_ROUTER_MAX_HIDDEN


def route_tokens_small_batch(hidden: torch.Tensor, gate_weight: torch.Tensor, spec: MoESpec, num_shared: int = 0,
                             residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
                             eps: float = 1e-6):
    """hidden [T, H] (any float dtype, read as fp32), gate_weight [E, H] fp32 (small_batch_router_applies) ->
    route_topk_triton(hidden.float() @ gate_weight.T) = (weights, ids) in one launch.

    With residual and norm_weight, the router's input is RMSNorm(hidden + residual) (fused_add_rmsnorm's rounding)
    -> (weights, ids, normed [T, H], hidden + residual [T, H]), still one launch."""
    num_tokens, hidden_size = hidden.shape
    num_experts = spec.n_routed_experts
    if not small_batch_router_applies(hidden):
        raise ValueError(f"route_tokens_small_batch routes up to {SMALL_BATCH_ROUTER_MAX_TOKENS} tokens of hidden "
                         f"size <= {SMALL_BATCH_ROUTER_MAX_HIDDEN}, got {tuple(hidden.shape)}")
    if gate_weight.shape != (num_experts, hidden_size) or gate_weight.dtype != torch.float32 \
            or not gate_weight.is_contiguous():
        raise ValueError(f"gate weight must be contiguous fp32 [{num_experts}, {hidden_size}], got "
                         f"{tuple(gate_weight.shape)} {gate_weight.dtype}")
    add_norm = residual is not None
    if add_norm and (norm_weight is None or residual.shape != hidden.shape or residual.dtype != hidden.dtype
                     or norm_weight.shape != (hidden_size,)):
        raise ValueError(f"the fused add-RMSNorm needs residual {tuple(hidden.shape)} {hidden.dtype} and a norm "
                         f"weight [{hidden_size}]")
    weights, ids = _route_outputs(num_tokens, spec.num_experts_per_tok + num_shared, hidden.device)
    hidden = _unit_column_stride(hidden)
    normed = residual_out = hidden
    if add_norm:
        residual = _unit_column_stride(residual)
        normed, residual_out = torch.empty_like(hidden), torch.empty_like(hidden)
    if num_tokens:
        constants = _routing_constants(spec, num_shared)
        experts_pow2 = constants["EXPERTS_POW2"]
        logits = torch.empty(num_tokens, experts_pow2, dtype=torch.float32, device=hidden.device)
        block_h = triton.next_power_of_2(hidden_size)
        # gate tiles of <= 4096 fp32 (BLOCK_E rows of the whole hidden size): 32 programs per token at V2-Lite's
        # E 64, H 2048
        block_e = max(1, min(triton.next_power_of_2(num_experts), 4096 // block_h))
        _router_small_batch_kernel[(triton.cdiv(num_experts, block_e), num_tokens)](
            hidden, residual if add_norm else hidden, norm_weight if add_norm else gate_weight, normed, residual_out,
            gate_weight, logits, _arrival_counter(hidden.device), weights, ids, num_tokens, hidden_size,
            hidden.stride(0), residual.stride(0) if add_norm else 0, normed.stride(0), residual_out.stride(0),
            float(eps), float(spec.routed_scaling_factor), **constants, BLOCK_T=_block_t(experts_pow2),
            BLOCK_E=block_e, BLOCK_H=block_h, ADD_NORM=add_norm, num_warps=4 if block_h <= 4096 else 8,
            **pdl.launch_options(hidden.device))
    return (weights, ids, normed, residual_out) if add_norm else (weights, ids)
