"""PrefixCache: the contract between the scheduler and a KV prefix cache (radix tree or none).

Ownership rule: every usable KV slot is owned by exactly one of the pool's free list, the cache, or
one running request (the slots in its req_to_token row that the cache does not own). A request's row
starts with the slots of its matched prefix, which the cache owns and the request keeps locked.

With a HybridKVPool (window_pool.py) a slot's window-layer KV follows the same owner, and may be released early:
`trim_window_kv` releases it for tokens no running request's window can see any more (`Req.window_kv_from`).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

import torch

from braid.runtime.core import host_to_device
from braid.runtime.mem_cache.window_pool import RELEASE_STEP, HybridKVPool

if TYPE_CHECKING:
    from braid.runtime.mem_cache.pools import KVPool, ReqToTokenPool


class PrefixCache(ABC):
    disabled: bool = False

    def __init__(self, req_to_token_pool: "ReqToTokenPool", kv_pool: "KVPool"):
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool

    def _empty_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.kv_pool.device)

    # ---- slots for new tokens ----
    @property
    def window_pool(self) -> Optional[HybridKVPool]:
        """The pool when window layers' KV is trimmed (a HybridKVPool), else None."""
        pool = self.kv_pool
        return pool if isinstance(pool, HybridKVPool) else None

    def available_slots(self) -> int:
        """Slots an allocation can get: free ones plus those eviction can free (with a hybrid pool, in the tighter
        of its two spaces: every new token takes a slot of each)."""
        full = self.kv_pool.available_size() + self.evictable_size()
        if self.window_pool is None:
            return full
        return min(full, self.window_pool.window_available_size() + self.window_evictable_size())

    def alloc_slots(self, n: int) -> Optional[torch.Tensor]:
        """n KV slots (int64), evicting cached prefixes as needed; None if even eviction leaves too few."""
        if n == 0:
            return self._empty_slots()
        short = n - self.kv_pool.available_size()
        short_window = n - self.window_pool.window_available_size() if self.window_pool is not None else 0
        if short > 0 or short_window > 0:
            self.evict(max(short, 0), max(short_window, 0))
        return self.kv_pool.alloc(n)

    def trim_window_kv(self, reqs, exact: bool = False) -> None:
        """Hybrid pool: release the window-layer KV of each request's tokens that its next query can no longer see
        (positions below kv_committed_len - window_keep), where no other request holds them; in steps of
        RELEASE_STEP positions unless `exact`. Call after every forward pass; the release runs on the device in
        stream order, after the pass (no sync)."""
        pool = self.window_pool
        if pool is None:
            return
        req_to_token = self.req_to_token_pool.req_to_token
        released: list[torch.Tensor] = []
        step = 1 if exact else RELEASE_STEP
        for req in reqs:
            if req.req_pool_idx is None:
                continue
            until = req.kv_committed_len - pool.window_keep(req)
            if until < req.window_kv_from + step:
                continue
            own_lo = self._cache_owned_len(req)
            released.extend(self._release_cached_window(req, until))
            lo = max(req.window_kv_from, own_lo)
            if until > lo:
                released.append(req_to_token[req.req_pool_idx, lo:until].long())
            req.window_kv_from = until
        if released:
            pool.release_window(torch.cat(released) if len(released) > 1 else released[0])

    def _release_cached_window(self, req, until: int) -> list[torch.Tensor]:
        """Cache-owned slots of the request below `until` whose window KV only it uses, now marked released."""
        return []

    def window_evictable_size(self) -> int:
        """Window slots (hybrid pool) held by cached tokens no request has locked."""
        return 0

    def truncate_req_kv(self, req, new_len: int) -> None:
        """Shorten a running request's committed KV to its first new_len tokens (jump-forward rolled tokens back):
        the slots the request owns past new_len go back to the pool; slots the cache owns stay the cache's."""
        self.truncate_reqs_kv([req], [new_len])

    def truncate_reqs_kv(self, reqs: list, new_lens: list[int]) -> None:
        """truncate_req_kv for each request and its new length (a speculative pass's rejected drafts), the slots of
        the whole batch gathered and freed at once."""
        pool = self.window_pool
        rows, cols = [], []
        for req, new_len in zip(reqs, new_lens):
            end = req.kv_committed_len
            if new_len >= end:
                continue
            if pool is not None and max(new_len - (pool.window - 1), 0) < req.window_kv_from:
                # the next query (position new_len) sees keys from new_len - (W - 1) on; window_keep's margin keeps
                # every rollback jump-forward can ask for above what trim_window_kv released
                raise RuntimeError(f"request {getattr(req, 'rid', '?')}: rolled back to {new_len} tokens, but the "
                                   f"window KV below position {req.window_kv_from} was released")
            lo = max(new_len, self._cache_owned_len(req))
            if lo < end:
                rows.extend(itertools.repeat(req.req_pool_idx, end - lo))
                cols.extend(range(lo, end))
            if req.prefix_indices is not None and new_len < len(req.prefix_indices):
                req.prefix_indices = req.prefix_indices[:new_len]
            req.kv_committed_len = new_len
        if rows:
            req_to_token = self.req_to_token_pool.req_to_token
            index = host_to_device(rows + cols, torch.int64, req_to_token.device).view(2, -1)
            self.kv_pool.free(req_to_token[index[0], index[1]].long())

    def _cache_owned_len(self, req) -> int:
        """How many leading slots of the request's row the cache owns (its locked prefix)."""
        return len(req.prefix_indices) if req.prefix_indices is not None else 0

    @abstractmethod
    def match_prefix(self, key: list[int], namespace: Optional[str] = None) -> tuple[torch.Tensor, Any]:
        """Longest cached prefix of `key` within `namespace` (a LoRA adapter's name; None: the base model): (its
        int64 KV slots, the node covering exactly it).

        Refreshes the LRU time of the matched path. The caller that keeps the slots must lock the node
        (inc_lock_ref) before anything can be evicted. To leave a token to compute logits from, pass
        the key without its last token.
        """

    @abstractmethod
    def cache_finished_req(self, req) -> None:
        """Hand a finished request's KV to the cache and release the request.

        Reads req.req_pool_idx, req.fill_ids, req.kv_committed_len (the first kv_committed_len tokens of
        fill_ids have their KV at req_to_token[req.req_pool_idx, :kv_committed_len]) and req.last_node.
        Afterwards the request owns no KV slot and no row: req.req_pool_idx and req.last_node are None.
        """

    @abstractmethod
    def cache_unfinished_req(self, req) -> None:
        """Make the committed KV of a request that goes on (chunked prefill, retraction) a cached prefix.

        Sets req.prefix_indices (int64, kv_committed_len slots, also written to its req_to_token row)
        and req.last_node (locked; the previous req.last_node is unlocked).
        """

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect the path root..node from eviction (counted; None is a no-op)."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref(node) (None is a no-op)."""

    @abstractmethod
    def evict(self, num_tokens: int, num_window_tokens: int = 0) -> int:
        """Free at least num_tokens slots and, with a hybrid pool, num_window_tokens window slots (fewer if less is
        evictable), least recently used first; return the count of (full) slots freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens no request has locked."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens on some locked path."""

    @abstractmethod
    def total_size(self) -> int:
        """All cached tokens (counted by walking the cache; equals evictable_size() + protected_size())."""

    def drop_namespace(self, namespace: str) -> int:
        """Free every cached prefix computed under `namespace` (an unloaded LoRA adapter's: nothing can match them
        again, and a later adapter of the same name must not). No request may hold a lock in it. -> tokens freed."""
        return 0

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry and free its slots. Only valid while no request holds a lock."""
