"""Sizing the KV pool: the bytes one token's KV takes over all layers, and the pool size a byte budget buys."""

from __future__ import annotations

from typing import Optional, Union

import torch

from braid.runtime.dtypes import kv_cache_dtype

__all__ = ["mha_kv_bytes_per_token", "mla_kv_bytes_per_token", "kv_cache_bytes_per_token", "max_tokens_for_budget",
           "window_tokens_for", "hybrid_tokens_for_budget", "KVPoolTooLarge", "check_kv_pool_fits"]


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


class KVPoolTooLarge(ValueError):
    """A KV pool the device cannot hold, refused before it is allocated."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_kv_pool_fits(tokens: int, pool_bytes: int, bytes_per_token: int, free_bytes: int, reserved_bytes: int,
                       fitting_tokens: int, *, device: str = "cuda", requested: bool = True,
                       mem_fraction_static: Optional[float] = None, capacity_bytes: Optional[int] = None,
                       kv_dtype: Optional[torch.dtype] = None, latent_bytes_per_token: Optional[int] = None,
                       heads_split_by_tp: bool = False) -> None:
    """Raises KVPoolTooLarge, naming the sizes and what to lower, when a pool of `tokens` slots (pool_bytes in all:
    dummy slots and a hybrid pool's window space included; bytes_per_token of KV a token) exceeds what the device
    has for it: free_bytes (free after the weights) less reserved_bytes (kept for activations and CUDA graphs:
    (1 - mem_fraction_static) x capacity_bytes where the user asked for the size, 0 for the smallest pool the runtime
    sizes on its own). fitting_tokens: the pool that the available bytes hold, by the runtime's own sizing.

    requested: the size came from --max-total-tokens; kv_dtype: the cache's dtype (fp8 is offered while it is
    wider); latent_bytes_per_token: a token's KV in MLA's latent layout when --disable-mla expanded it;
    heads_split_by_tp: more GPUs (--tp-size) would split the KV heads. A pure function of sizes."""
    available = free_bytes - reserved_bytes
    if pool_bytes <= available:
        return
    what = (f"--max-total-tokens {tokens:,}" if requested else
            f"the smallest KV pool braid sizes on its own ({tokens:,} tokens)")
    where = f"{free_bytes:,} bytes ({_gib(free_bytes)}) free on {device} after the weights"
    if reserved_bytes:
        share = (f"(1 - --mem-fraction-static {mem_fraction_static}) x {capacity_bytes:,} bytes of device memory"
                 if mem_fraction_static is not None and capacity_bytes is not None else "by --mem-fraction-static")
        where += (f", less {reserved_bytes:,} bytes ({_gib(reserved_bytes)}) kept for activations and CUDA graphs: "
                  f"{share}")
    lower = []
    if requested:
        lower.append(f"lower --max-total-tokens to at most {max(fitting_tokens, 0):,}")
    elif fitting_tokens > 0:
        lower.append(f"ask for a smaller pool with --max-total-tokens (at most {fitting_tokens:,} fit)")
    if mem_fraction_static is not None and capacity_bytes:
        needed = 1 - (free_bytes - pool_bytes) / capacity_bytes
        if pool_bytes < free_bytes and needed < 1:
            lower.append(f"raise --mem-fraction-static from {mem_fraction_static} to at least {needed:.3f} (less "
                         "room for activations and CUDA graphs)")
    if kv_dtype is not None and kv_dtype.itemsize > 1:
        lower.append(f"store the KV in fp8 with --kv-cache-dtype fp8_e4m3 or fp8_e5m2 (1 byte a value instead of "
                     f"{kv_dtype.itemsize}: {str(kv_dtype).replace('torch.', '')})")
    if latent_bytes_per_token is not None:
        lower.append(f"drop --disable-mla (the latent cache takes {latent_bytes_per_token:,} bytes a token)")
    if heads_split_by_tp:
        lower.append("split the KV heads over more GPUs with --tp-size")
    if not lower:
        lower.append("free memory that other processes hold on the device, or use one with more memory")
    raise KVPoolTooLarge(
        f"{what} needs a KV pool of {pool_bytes:,} bytes ({_gib(pool_bytes)}; {bytes_per_token:,} bytes a token), "
        f"more than the {max(available, 0):,} bytes ({_gib(max(available, 0))}) available for it: {where}. To fit: "
        + "; or ".join(lower) + ".")
