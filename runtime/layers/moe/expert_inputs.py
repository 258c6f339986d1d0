"""The routed experts' inputs as every expert path takes them (experts.py's reference and dispatch, the Triton kernels
of fused_moe_kernels.py and small_batch_kernels.py): one check, below all of them."""

from __future__ import annotations

from typing import Optional

import torch

SUPPORTED_ACTIVATIONS = ("silu",)


def check_expert_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: str, w13_scale: Optional[torch.Tensor] = None,
                        w2_scale: Optional[torch.Tensor] = None) -> None:
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"MoE activation {activation!r} is not supported; expected one of {SUPPORTED_ACTIVATIONS}")
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_inter, hidden_size = w13.shape
    if two_inter % 2 or hidden.shape[1] != hidden_size or w2.shape != (num_experts, hidden_size, two_inter // 2):
        raise ValueError(f"expert weight shapes disagree: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [T={hidden.shape[0]}, k]")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fp8 experts need the scales of both w13 and w2")
    if w13_scale is not None:
        if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn \
                or w13_scale.shape != w13.shape[:2] or w2_scale.shape != w2.shape[:2] \
                or w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32 \
                or not (w13_scale.is_contiguous() and w2_scale.is_contiguous()):
            raise ValueError(f"fp8 experts: e4m3 w13 / w2 with contiguous fp32 per-row scales [E, 2I] / [E, H]; got "
                             f"{w13.dtype} {tuple(w13.shape)}, {w2.dtype} {tuple(w2.shape)}, scales "
                             f"{w13_scale.dtype} {tuple(w13_scale.shape)}, {w2_scale.dtype} {tuple(w2_scale.shape)}")
    elif hidden.dtype != w13.dtype or hidden.dtype != w2.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and expert weights ({w13.dtype}, {w2.dtype}) must share a dtype")
