"""AttentionBackend: the contract every attention implementation fulfils.

Layers never touch the KV cache layout themselves: `RadixAttention.forward(q, k, v, fb)` hands its
projections to `fb.attn_backend.forward(...)`, which stores k/v at `fb.out_cache_loc` through the pool's
`set_kv` (the pool is the only writer of KV) and attends over the request's whole cached sequence via
`req_to_token`.

Shapes (T = tokens in this forward pass, B = requests, H = query heads, Hkv = KV heads):
  q: [T, H * head_dim]   k: [T, Hkv * head_dim]   v: [T, Hkv * v_head_dim]   out: [T, H * v_head_dim]
For DECODE, T == B (one token per request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from braid.runtime.core import ForwardBatch
    from braid.runtime.layers.radix_attention import RadixAttention


class AttentionBackend(ABC):
    """One instance per ModelRunner. Stateless across batches except for per-batch metadata."""

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        """Compute whatever this backend needs for the batch, once, before the layers run."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                fb: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        if fb.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, fb, save_kv_cache)
        return self.forward_extend(q, k, v, layer, fb, save_kv_cache)

    # fb.tree_mask (speculative tree verify): extend passes whose new tokens attend to each other through a mask
    supports_tree_mask = False

    @abstractmethod
    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True) -> torch.Tensor:
        """New tokens (fb.extend_seq_lens per request) attend to their cached prefix
        (fb.extend_prefix_lens tokens, already in the pool) and causally to each other (or, given fb.tree_mask and
        supports_tree_mask, to those their request's mask marks)."""

    @abstractmethod
    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True) -> torch.Tensor:
        """One new token per request attends to all fb.seq_lens[i] tokens (itself included)."""

    # ---- CUDA graph hooks (extend: TritonAttnBackend only); backends that cannot be captured keep the defaults ----
    supports_extend_cuda_graph = False  # ExtendCudaGraphRunner: init_extend_graph_state / init_extend_graph_metadata

    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture(self, bs: int, fb: "ForwardBatch") -> None:
        raise NotImplementedError

    def init_forward_metadata_replay(self, bs: int, fb: "ForwardBatch") -> None:
        raise NotImplementedError
