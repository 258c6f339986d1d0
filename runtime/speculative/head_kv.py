"""The EAGLE draft head's KV: every request's K and V of the head's layers in one paged pool (`HeadKVPool`), a
request's rows reached through its `HeadKVCache` (on `Req.spec_state`, runtime/speculative/eagle.py).

A page holds PAGE consecutive rows of one request; the pool grows (doubling its pages) when a request needs more
than the free ones, and pages go back as requests truncate or finish. Memory follows the requests' lengths (not
the longest times the batch); runtime/speculative/head_batch.py gathers a batch's rows into a padded layout for one
attention call a layer.
"""

from __future__ import annotations

import weakref

import torch

PAGE = 16  # rows a page


class HeadKVPool:
    """Per layer K and V [pages * PAGE, kv_heads, head_dim] (zeros where never written: a padded gather may read
    any row, and masked attention multiplies what it reads by 0, so no row may hold NaN); `free` the page ids not
    held by a request."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device, dtype):
        self.shape = (num_kv_heads, head_dim)
        self.device, self.dtype = device, dtype
        self.k = [torch.zeros(0, num_kv_heads, head_dim, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(0, num_kv_heads, head_dim, device=device, dtype=dtype) for _ in range(num_layers)]
        self.num_pages = 0
        self.free: list[int] = []

    def alloc(self, n: int) -> list[int]:
        if len(self.free) < n:
            self._grow(max(2 * self.num_pages, self.num_pages + n, 4))
        # pop one by one: a finalizer (`HeadKVCache`) may give pages back at any point, only ever appending
        return [self.free.pop() for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(pages)

    def _grow(self, pages: int) -> None:
        rows = self.num_pages * PAGE
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = torch.zeros(pages * PAGE, *self.shape, device=self.device, dtype=self.dtype)
                new[:rows] = old
                buffers[i] = new
        # the new pages, lowest id last: handed out first
        self.free[:0] = range(pages - 1, self.num_pages - 1, -1)
        self.num_pages = pages


class HeadKVCache:
    """One request's draft-head KV: rows 0..length-1 hold the head's input at positions start..start+length-1 (row
    r's token in tokens[r]), row r in pool row pages[r // PAGE] * PAGE + r % PAGE. Rolling back is truncate (pages
    past the new length go back). The pages go back when the cache is closed or garbage-collected."""

    def __init__(self, pool: HeadKVPool, start: int = 0):
        self.pool = pool
        self.pages: list[int] = []
        self.start = start
        self.length = 0
        self.tokens: list[int] = []
        # the list object, not the cache: whatever pages it holds when the cache goes
        weakref.finalize(self, pool.give_back, self.pages)

    def reset(self, start: int) -> None:
        self.truncate(0)
        self.start = start

    def truncate(self, length: int) -> None:
        length = max(0, min(length, self.length))
        self.length = length
        del self.tokens[length:]
        keep = -(-length // PAGE)
        if keep < len(self.pages):
            self.pool.give_back(self.pages[keep:])
            del self.pages[keep:]

    def close(self) -> None:
        self.truncate(0)

    def reserve(self, rows: int) -> None:
        """Pages for `rows` more rows past length."""
        need = -(-(self.length + rows) // PAGE) - len(self.pages)
        if need > 0:
            self.pages.extend(self.pool.alloc(need))

    def pool_rows(self, lo: int, hi: int) -> list[int]:
        """The pool rows of rows lo..hi-1 (reserved)."""
        return [self.pages[r // PAGE] * PAGE + r % PAGE for r in range(lo, hi)]
