from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from braid.runtime.layers.gemv import RotaryKVStore


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

    def rotary_kv_store(self, fb, positions: torch.Tensor, rotary) -> Optional[RotaryKVStore]:
        """At decode, the epilogue that the qkv projection takes as its `act`: rotate q and k and write k and v to
        this layer's cache (in the batch-1 GEMV's epilogue where the pool lets it; else by the pool's
        rotate_and_set_kv), leaving q [T, H*D] rotated for forward(q, None, None, fb, save_kv_cache=False). None
        elsewhere (extend; inside torch.compile, where attention stays outside the graph)."""
        if torch.compiler.is_compiling() or not fb.forward_mode.is_decode():
            return None
        pool, layer_id, loc = fb.kv_pool, self.layer_id, fb.out_cache_loc
        return RotaryKVStore(
            self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim, positions, rotary,
            target=lambda: pool.rotary_store_target(layer_id, loc),
            unfused=lambda q, k, v: pool.rotate_and_set_kv(layer_id, loc, positions, q, k, v, rotary))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb, save_kv_cache: bool = True,
                rotary=None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, H*D], k: [T, Hkv*D], v: [T, Hkv*Dv] -> [T, H*Dv].

        rotary (a RotaryEmbedding) with positions [T]: q and k are not rotated yet; rotation happens here,
        in decode through the pool's rotate_and_set_kv (one launch with the KV write where the pool can)."""
        if torch.compiler.is_compiling():
            return _attend_outside_compile(self, q, k, v, fb, save_kv_cache, rotary, positions)
        return _attend(self, q, k, v, fb, save_kv_cache, rotary, positions)


def _attend(layer: RadixAttention, q, k, v, fb, save_kv_cache: bool, rotary, positions) -> torch.Tensor:
    if rotary is not None:
        # decode only: there every backend reads the keys from the pool (extend kernels take the new ones from k)
        if save_kv_cache and fb.forward_mode.is_decode():
            q = fb.kv_pool.rotate_and_set_kv(layer.layer_id, fb.out_cache_loc, positions, q, k, v, rotary)
            save_kv_cache = False
        else:
            q, k = rotary(positions, q, k)
    return fb.attn_backend.forward(q, k, v, layer, fb, save_kv_cache)


@torch.compiler.disable
def _attend_outside_compile(layer: RadixAttention, q, k, v, fb, save_kv_cache: bool, rotary, positions):
    # torch.compile fuses the model's other ops; attention stays the backend's own kernels (and its Python metadata)
    return _attend(layer, q, k, v, fb, save_kv_cache, rotary, positions)
