"""Mixture of experts: routing (router.py; router_kernels.py, its one-launch Triton form), the experts' computation
(experts.py: PyTorch reference and dispatch; fused_moe_kernels.py: the fused Triton path) and the FusedMoE layer
with its checkpoint loading (layer.py)."""

from braid.runtime.layers.moe.experts import fused_experts, moe_forward_torch
from braid.runtime.layers.moe.layer import FusedMoE, MoEGate, route_expert_weights
from braid.runtime.layers.moe.router import select_experts

__all__ = ["select_experts", "fused_experts", "moe_forward_torch", "FusedMoE", "MoEGate", "route_expert_weights"]
