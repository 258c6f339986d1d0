"""Expert selection in one Triton launch: softmax over the router logits, the group limit, top-k, renormalization and
routed_scaling_factor (router.py's PyTorch path does the same in 3 to 9 launches, which at decode batch sizes cost
more than the work). Each program routes BLOCK_T tokens with all E scores in registers; the k experts are taken by
repeated arg-max (the lowest expert id wins a tie). Runs on CPU tensors under TRITON_INTERPRET=1 (the tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.runtime.loader.config_specs import MoESpec


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, logits_stride, scaling,
                       NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, TOP_K: tl.constexpr,
                       TOP_K_POW2: tl.constexpr, GROUP_LIMITED: tl.constexpr, NUM_GROUPS: tl.constexpr,
                       GROUPS_POW2: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                       RENORMALIZE: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_valid = rows < num_tokens
    experts = tl.arange(0, EXPERTS_POW2)
    expert_valid = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + experts[None, :],
                     mask=row_valid[:, None] & expert_valid[None, :], other=float("-inf")).to(tl.float32)
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
    slots = tl.arange(0, TOP_K_POW2)
    top_weights = tl.zeros((BLOCK_T, TOP_K_POW2), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, TOP_K_POW2), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=1)
        chosen = tl.min(tl.where(scores == best[:, None], experts[None, :], EXPERTS_POW2), axis=1)
        top_weights = tl.where(slots[None, :] == j, best[:, None], top_weights)
        top_ids = tl.where(slots[None, :] == j, chosen[:, None], top_ids)
        scores = tl.where(experts[None, :] == chosen[:, None], -2.0, scores)
    if RENORMALIZE:
        top_weights = top_weights / (tl.sum(top_weights, axis=1)[:, None] + 1e-20)
    top_weights = top_weights * scaling
    out_offsets = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = row_valid[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out_offsets, top_weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, top_ids, mask=out_mask)


def route_topk_triton(router_logits: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (fp32) -> (topk_weights [T, k] fp32, topk_ids [T, k] int32), k ids by falling score."""
    num_tokens, num_experts = router_logits.shape
    top_k = spec.num_experts_per_tok
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    experts_pow2 = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // experts_pow2))
    group_limited = spec.topk_method == "group_limited_greedy"
    num_groups = spec.n_group if group_limited else 1
    _route_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_tokens, router_logits.stride(0), float(spec.routed_scaling_factor),
        NUM_EXPERTS=num_experts, EXPERTS_POW2=experts_pow2, TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k),
        GROUP_LIMITED=group_limited, NUM_GROUPS=num_groups, GROUPS_POW2=triton.next_power_of_2(num_groups),
        GROUP_SIZE=num_experts // num_groups,
        TOPK_GROUPS=spec.topk_group if group_limited else 1, RENORMALIZE=spec.norm_topk_prob, BLOCK_T=block_t,
        num_warps=4)
    return weights, ids
