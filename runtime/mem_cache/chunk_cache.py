"""ChunkCache: the prefix cache used when radix caching is off. Nothing is shared between requests; a
request's own earlier chunks are its prefix while its prompt is prefilled chunk by chunk."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from braid.runtime.mem_cache.base import PrefixCache

__all__ = ["ChunkCache"]


class ChunkCache(PrefixCache):
    disabled = True

    def match_prefix(self, key: Sequence[int], namespace: Optional[str] = None) -> tuple[torch.Tensor, None]:
        return self._empty_slots(), None

    def cache_finished_req(self, req) -> None:
        if req.req_pool_idx is None:
            raise RuntimeError(f"request {getattr(req, 'rid', '?')} has no req_to_token row to release")
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len]
        if self.window_pool is not None:
            # the request's window slots are those from window_kv_from on: released without a device sync
            self.window_pool.release_window(slots[min(req.window_kv_from, req.kv_committed_len):])
            self.window_pool.free(slots, window_released=True)
        else:
            self.kv_pool.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        if self.window_pool is not None:
            req.window_kv_from = 0

    def cache_unfinished_req(self, req) -> None:
        if req.req_pool_idx is None:
            raise RuntimeError(f"request {getattr(req, 'rid', '?')} has no req_to_token row")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len]
        req.prefix_indices = row.to(device=self.kv_pool.device, dtype=torch.int64, copy=True)

    def _cache_owned_len(self, req) -> int:
        return 0  # a request's prefix_indices are its own slots here, freed with it

    def inc_lock_ref(self, node) -> None:
        pass

    def dec_lock_ref(self, node) -> None:
        pass

    def evict(self, num_tokens: int, num_window_tokens: int = 0) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
