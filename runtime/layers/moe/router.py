"""Expert selection from router logits: greedy and group-limited greedy top-k over softmax scores (DeepSeek-V2).

The order of operations follows HF transformers' DeepseekV2TopkRouter: softmax in fp32, (group mask,) top-k, then
the weights are scaled by routed_scaling_factor. HF's DeepseekV2 router does not read norm_topk_prob; here
norm_topk_prob renormalizes the k weights to sum to 1 before the scaling (as DeepSeek-V3 and SGLang/vLLM do). The
released DeepSeek-V2 / V2-Lite / Coder-V2 configs all have norm_topk_prob false, where both agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from braid.runtime.loader.config_specs import MoESpec

SUPPORTED_TOPK_METHODS = ("greedy", "group_limited_greedy")


def check_routing_supported(spec: MoESpec) -> None:
    if spec.topk_method not in SUPPORTED_TOPK_METHODS:
        raise ValueError(f"MoE topk_method {spec.topk_method!r} is not implemented; braid routes with "
                         f"{SUPPORTED_TOPK_METHODS}")


def select_experts(router_logits: torch.Tensor, spec: MoESpec,
                   num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (fp32) -> (topk_weights [T, k + S] fp32, topk_ids [T, k + S] int32); k =
    num_experts_per_tok, then S = num_shared always-chosen slots: expert E + s with weight 1 (the shared experts,
    stacked after the routed ones).

    CUDA tensors take one Triton launch (router_kernels.py), others the PyTorch ops below. No host
    synchronization: usable inside CUDA graphs. The k routed ids of a token come in no particular order."""
    check_routing_supported(spec)
    num_tokens, num_experts = router_logits.shape
    if num_experts != spec.n_routed_experts:
        raise ValueError(f"router logits have {num_experts} experts, the MoE spec {spec.n_routed_experts}")
    if router_logits.is_cuda:
        from braid.runtime.layers.moe.router_kernels import route_topk_triton

        return route_topk_triton(router_logits, spec, num_shared)
    return select_experts_torch(router_logits, spec, num_shared)


def route_hidden(hidden: torch.Tensor, gate_weight: torch.Tensor, spec: MoESpec,
                 num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router from the layer input: select_experts(hidden.float() @ gate_weight.T, spec, num_shared).
    hidden [T, H], gate_weight [E, H] fp32. On CUDA, up to 16 tokens (decode; router_kernels) take one launch for
    the matmul and the selection together."""
    if hidden.is_cuda:
        from braid.runtime.layers.moe.router_kernels import route_tokens_small_batch, small_batch_router_applies

        if small_batch_router_applies(hidden):
            check_routing_supported(spec)
            return route_tokens_small_batch(hidden, gate_weight, spec, num_shared)
    return select_experts(F.linear(hidden.float(), gate_weight.float()), spec, num_shared)


def norm_and_route(hidden: torch.Tensor, residual: torch.Tensor, norm, gate_weight: torch.Tensor, spec: MoESpec,
                   num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """normed, residual_out = norm(hidden, residual) (an RMSNorm with the residual add), then
    route_hidden(normed, ...) -> (weights, ids, normed, residual_out). On CUDA at decode sizes the norm runs inside
    the router's one launch."""
    if hidden.is_cuda and not norm.add_unit_offset and residual.dtype == hidden.dtype:
        from braid.runtime.layers.moe.router_kernels import route_tokens_small_batch, small_batch_router_applies

        if small_batch_router_applies(hidden):
            check_routing_supported(spec)
            return route_tokens_small_batch(hidden, gate_weight, spec, num_shared, residual=residual,
                                            norm_weight=norm.weight, eps=norm.eps)
    normed, residual = norm(hidden, residual)
    return (*route_hidden(normed, gate_weight, spec, num_shared), normed, residual)


def select_experts_torch(router_logits: torch.Tensor, spec: MoESpec,
                         num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in PyTorch ops, in HF DeepseekV2TopkRouter's order."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().softmax(dim=-1)
    if spec.topk_method == "group_limited_greedy":
        # a group's score is its best expert's; only experts of the topk_group best groups stay selectable
        grouped = scores.view(num_tokens, spec.n_group, num_experts // spec.n_group)
        best_groups = grouped.amax(dim=-1).topk(spec.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        keep = torch.zeros(num_tokens, spec.n_group, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view(num_tokens, num_experts)
    topk_weights, topk_ids = scores.topk(spec.num_experts_per_tok, dim=-1, sorted=False)
    if spec.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * spec.routed_scaling_factor
    topk_ids = topk_ids.to(torch.int32)
    if num_shared:
        shared_ids = torch.arange(num_experts, num_experts + num_shared, dtype=torch.int32, device=scores.device)
        topk_ids = torch.cat([topk_ids, shared_ids.expand(num_tokens, num_shared)], dim=1)
        topk_weights = torch.cat([topk_weights, topk_weights.new_ones(num_tokens, num_shared)], dim=1)
    return topk_weights, topk_ids
