from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RadixAttention(nn.Module):
    """Attention over the paged KV cache; the actual work is the batch's attention backend's."""

    def __init__(self, layer_id: int, num_heads: int, head_dim: int, num_kv_heads: int, scaling: float,
                 sliding_window: int = -1, logit_cap: float = 0.0, v_head_dim: Optional[int] = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scaling = scaling
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else -1
        self.logit_cap = logit_cap or 0.0
        self.v_head_dim = v_head_dim or head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb, save_kv_cache: bool = True) -> torch.Tensor:
        # q: [T, H*D], k: [T, Hkv*D], v: [T, Hkv*Dv] -> [T, H*Dv]
        if torch.compiler.is_compiling():
            return _attend_outside_compile(self, q, k, v, fb, save_kv_cache)
        return fb.attn_backend.forward(q, k, v, self, fb, save_kv_cache)


@torch.compiler.disable
def _attend_outside_compile(layer: RadixAttention, q, k, v, fb, save_kv_cache: bool) -> torch.Tensor:
    # torch.compile fuses the model's other ops; attention stays the backend's own kernels (and its Python metadata)
    return fb.attn_backend.forward(q, k, v, layer, fb, save_kv_cache)
