"""The routed experts' computation: out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)),
e = topk_ids[t, j]; a PyTorch reference (`moe_forward_torch`) and the Triton paths (small_batch_kernels.py for
decode batches, fused_moe_kernels.py above them), which `fused_experts` picks for CUDA tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from braid.runtime.layers.moe.expert_inputs import check_expert_inputs

if TYPE_CHECKING:
    from braid.runtime.layers.moe.fused_moe_kernels import MoEKernelConfig


def moe_forward_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: str = "silu", w13_scale: Optional[torch.Tensor] = None,
                      w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference: per selected expert, gather its tokens and run two matmuls. Sums in fp32.
    hidden [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] -> [T, H] in hidden's dtype; fp8 experts:
    e4m3 w13 / w2 with fp32 row scales w13_scale [E, 2I] / w2_scale [E, H], each expert dequantized to hidden's
    dtype as it runs. Reads the per-expert token counts on the host: not for CUDA graphs."""
    check_expert_inputs(hidden, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)  # [T*k] positions into the flattened (token, slot) pairs
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(hidden[tokens], _expert(w13, w13_scale, expert, hidden.dtype)).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, _expert(w2, w2_scale, expert, hidden.dtype))  # [count, H]
        out.index_add_(0, tokens, expert_out.float() * topk_weights.reshape(-1)[pairs, None].float())
    return out.to(hidden.dtype)


def _expert(w: torch.Tensor, scale: Optional[torch.Tensor], expert: int, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[expert]
    return (w[expert].float() * scale[expert][:, None]).to(dtype)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu",
                  config: Optional["MoEKernelConfig"] = None, w13_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k] int -> [T, H]; fp8
    experts: e4m3 w13 / w2 with fp32 row scales [E, 2I] / [E, H] (the kernels stream e4m3 and scale in-kernel).

    CUDA tensors take Triton kernels (no host sync, CUDA-graph capturable): up to SMALL_BATCH_MAX_TOKENS tokens the
    two GEMV-style launches of small_batch_kernels.py, more the sorted grouped GEMM of fused_moe_kernels.py
    (`config` picks its block sizes at any T, see MoEKernelConfig); anything else the PyTorch reference."""
    if hidden.is_cuda:
        from braid.runtime.layers.moe.fused_moe_kernels import fused_moe_triton
        from braid.runtime.layers.moe.small_batch_kernels import SMALL_BATCH_MAX_TOKENS, small_batch_moe

        if config is None and hidden.shape[0] <= SMALL_BATCH_MAX_TOKENS:
            return small_batch_moe(hidden, w13, w2, topk_weights, topk_ids, activation, w13_scale=w13_scale,
                                   w2_scale=w2_scale)
        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, activation, config, w13_scale, w2_scale)
    if config is not None:
        raise ValueError("a kernel config applies to the fused Triton path (CUDA tensors) only")
    return moe_forward_torch(hidden, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale)
