"""Sizing the KV pool: the bytes one token's KV takes over all layers, and the pool size a byte budget buys."""

from __future__ import annotations

from typing import Optional, Union

import torch

from braid.runtime.layers.dtypes import kv_cache_dtype

__all__ = ["mha_kv_bytes_per_token", "mla_kv_bytes_per_token", "kv_cache_bytes_per_token", "max_tokens_for_budget",
           "window_tokens_for", "hybrid_tokens_for_budget"]


def _cache_itemsize(dtype: Union[str, torch.dtype]) -> int:
    # Strings name the KV cache dtype ("bfloat16", "fp8_e5m2", ...); "auto" has no size on its own.
    if isinstance(dtype, str):
        if dtype == "auto":
            raise ValueError("resolve 'auto' to the model dtype before sizing the KV cache")
        dtype = kv_cache_dtype(dtype, torch.float32)
    return dtype.itemsize


def mha_kv_bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: Union[str, torch.dtype],
                           v_head_dim: Optional[int] = None) -> int:
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return head_num * (head_dim + v_head_dim) * layer_num * _cache_itemsize(dtype)


def mla_kv_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int,
                           dtype: Union[str, torch.dtype]) -> int:
    return (kv_lora_rank + qk_rope_head_dim) * layer_num * _cache_itemsize(dtype)


def kv_cache_bytes_per_token(layer_num: int, dtype: Union[str, torch.dtype], *, head_num: Optional[int] = None,
                             head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
                             kv_lora_rank: Optional[int] = None, qk_rope_head_dim: Optional[int] = None) -> int:
    """Bytes of KV one token takes over all layers: MLA when kv_lora_rank is given, else MHA (per-rank heads)."""
    if kv_lora_rank is not None:
        if qk_rope_head_dim is None:
            raise ValueError("MLA sizing needs qk_rope_head_dim")
        return mla_kv_bytes_per_token(kv_lora_rank, qk_rope_head_dim, layer_num, dtype)
    if head_num is None or head_dim is None:
        raise ValueError("MHA sizing needs head_num and head_dim")
    return mha_kv_bytes_per_token(head_num, head_dim, layer_num, dtype, v_head_dim)


def max_tokens_for_budget(budget_bytes: int, bytes_per_token: int) -> int:
    """Usable pool size for a byte budget; the +1 dummy slot is paid for out of the budget too."""
    if bytes_per_token <= 0:
        raise ValueError("bytes_per_token must be positive")
    return max(int(budget_bytes // bytes_per_token) - 1, 0)


def window_tokens_for(full_tokens: int, window: int, context_len: int, prefill_tokens: int,
                      ratio: Optional[float] = None) -> int:
    """Window slots of a hybrid pool (mem_cache/window_pool.py) whose full-layer pool holds full_tokens.

    Default: enough for the windows of as many context_len-long requests as the full pool holds (each keeps at most
    `window`), plus one extend batch's new tokens (they all get window slots until the pass ends). `ratio`: window
    slots per full slot instead, never fewer than one extend batch plus a window. Never more than full_tokens."""
    if min(full_tokens, window, context_len, prefill_tokens) < 1:
        raise ValueError("window sizing needs positive full_tokens, window, context_len and prefill_tokens")
    if ratio is not None:
        return min(full_tokens, max(-(-int(full_tokens * ratio * 1024) // 1024), prefill_tokens + window))
    running_windows = -(-full_tokens * min(window, context_len) // context_len)
    return min(full_tokens, running_windows + prefill_tokens)


def hybrid_tokens_for_budget(budget_bytes: int, full_bytes_per_token: int, window_bytes_per_token: int, window: int,
                             context_len: int, prefill_tokens: int, ratio: Optional[float] = None) -> tuple[int, int]:
    """(full tokens, window tokens) of a hybrid pool that fits budget_bytes, the window space sized by
    window_tokens_for (each space's +1 dummy slot paid out of the budget)."""
    if full_bytes_per_token <= 0 or window_bytes_per_token <= 0:
        raise ValueError("bytes per token must be positive")
    # full * f + (full * r + prefill) * w = budget (r = window / context_len, or the ratio given), solved for full;
    # when that fits less than an untrimmed split (both spaces one size), the untrimmed split is taken
    usable = budget_bytes - full_bytes_per_token - window_bytes_per_token * (1 + (0 if ratio else prefill_tokens))
    r = ratio if ratio is not None else min(window, context_len) / context_len
    full = max(int(usable / (full_bytes_per_token + r * window_bytes_per_token)), 0)
    while full and (full * full_bytes_per_token + window_tokens_for(full, window, context_len, prefill_tokens, ratio)
                    * window_bytes_per_token > budget_bytes - full_bytes_per_token - window_bytes_per_token):
        full -= max(full // 1000, 1)  # the window term rounds up
    full = max(full, max_tokens_for_budget(budget_bytes, full_bytes_per_token + window_bytes_per_token), 1)
    return full, window_tokens_for(full, window, context_len, prefill_tokens, ratio)
