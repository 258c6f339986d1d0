"""PrefixCache: the contract between the scheduler and a KV prefix cache (radix tree or none).

Ownership rule: every usable KV slot is owned by exactly one of the pool's free list, the cache, or
one running request (the slots in its req_to_token row that the cache does not own). A request's row
starts with the slots of its matched prefix, which the cache owns and the request keeps locked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from braid.runtime.mem_cache.pools import KVPool, ReqToTokenPool


class PrefixCache(ABC):
    disabled: bool = False

    def __init__(self, req_to_token_pool: "ReqToTokenPool", token_to_kv_pool: "KVPool"):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool

    def _empty_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.token_to_kv_pool.device)

    @abstractmethod
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, Any]:
        """Longest cached prefix of `key`: (its int64 KV slots, the node covering exactly it).

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
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots (fewer if less is evictable), least recently used first; return the count."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens no request has locked."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens on some locked path."""

    @abstractmethod
    def total_size(self) -> int:
        """All cached tokens (counted by walking the cache; equals evictable_size() + protected_size())."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry and free its slots. Only valid while no request holds a lock."""
