"""Triton attention kernels over the paged KV cache (extend/prefill and split-KV decode)."""

from braid.runtime.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from braid.runtime.layers.attention.triton_ops.extend_attention import extend_attention_fwd

__all__ = ["decode_attention_fwd", "extend_attention_fwd"]
