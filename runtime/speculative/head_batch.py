"""A propose call's requests side by side for the draft head: one attention call a layer a pass for the whole batch
(one per group, below), and nothing the head does waits for the host.

A call first runs the catch-up rows (depth 0: rows appended to each request's HeadKVCache, head_kv.py), then
`draft_steps` draft depths of `width` rows a request (a chain: 1; a tree: topk), which never enter the pool.

Layout. Request i has c0_i committed rows before the catch-up and c_i after it. A layer's working K and V are
gathered from the pool once a call, [P, Lc + tail, kv_heads, head_dim] a group: columns 0..c_i-1 the request's
committed rows, padding up to Lc = the group's largest c_i (masked), then tail = draft_steps * width columns, depth
d's rows at Lc + (d - 1) * width onwards, written there as the depths run. A draft row attends over the committed
columns and the draft columns of its ancestors and itself (a chain: every earlier depth; a tree: the ancestors the
proposer hands in, TreeExpansion.frontier_ancestors).

Host work. Positions, gather indices and masks come from host integers the proposer already has: lists of ints,
sent to the device in one copy when the batch is made, the indices and masks built from them there (a few small
ops) before any of the head's work.

Groups. Padding costs memory and work in proportion to the longest request: the requests are split into runs of
the given order (the proposer gives them longest first) whose padded rows stay within twice their rows or SLACK,
one attention call a layer each; usually one group.

Catch-up queries: request i's n_i rows, row j at column c0_i + j attending over columns <= c0_i + j, padded to the
group's largest n_i; a request with more than LONG rows (a prompt's first catch-up) attends on its own instead of
padding every request's queries to its length.

Grouped-query attention: on CUDA the query heads that share a KV head run as its query rows (`_grouped_as_rows`).
"""

from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from braid.runtime.speculative.head_kv import PAGE, HeadKVCache, HeadKVPool

LONG = 64  # catch-up rows past which a request attends alone
SLACK = 1 << 15  # padded rows a group may hold however uneven its requests
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
            causal: bool = False, gqa: bool = False) -> torch.Tensor:
    """q [B, Hq, n, hd]; k, v [B, Hkv, L, hd] -> [B, Hq, n, hd]."""
    if q.device.type == "cpu":
        # the math kernel, which the dense reference (EagleHead.forward, 3-D inputs) runs too: CPU's flash kernel
        # rounds differently. It adds its mask (scaled_dot_product_attention turns a bool one into this first)
        if mask is not None:
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        return _MATH(q, k, v, mask, is_causal=causal, enable_gqa=gqa)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q [B, n, heads, hd]; k, v [B, L, kv_heads, hd]; mask [B, 1, n or 1, L] bool (True: attended) or None -> [B, n,
    heads, hd]."""
    group = q.shape[2] // k.shape[2]
    if group > 1 and q.device.type != "cpu":
        return _grouped_as_rows(q, k, v, mask)
    # CPU: the math kernel repeats K and V for GQA itself, as the dense reference does
    return _kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, gqa=group > 1).transpose(1, 2)


def _grouped_as_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """`_attention` with the `group` query heads that share a KV head run as that head's query rows ([B, kv_heads,
    n * group, hd]; row r * group + j is row r's head kv * group + j): K and V are never repeated and the kernel need
    not support GQA (CUDA's memory-efficient kernel, the one that takes a mask, does not: with enable_gqa and a mask
    SDPA falls back to the math kernel, pytorch/pytorch#139586)."""
    B, n, heads, hd = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    rows = q.view(B, n, kv_heads, group, hd).transpose(1, 2).reshape(B, kv_heads, n * group, hd)
    if mask is not None and mask.shape[2] > 1:  # [B, 1, n, L] -> [B, 1, n * group, L]
        mask = mask.unsqueeze(3).expand(B, 1, n, group, mask.shape[3]).reshape(B, 1, n * group, mask.shape[3])
    out = _kernel(rows, k.transpose(1, 2), v.transpose(1, 2), mask)  # [B, kv_heads, n * group, hd]
    return out.view(B, kv_heads, n, group, hd).transpose(1, 2).reshape(B, n, heads, hd)


def _send(hosts: list[dict[str, list[int]]], device) -> list[dict[str, torch.Tensor]]:
    """Lists of ints on the host -> int64 tensors on the device, in one copy (to CUDA through pinned memory, not
    waiting for the GPU)."""
    entries = [(j, name, v) for j, host in enumerate(hosts) for name, v in host.items()]
    flat = torch.from_numpy(np.array([x for _, _, v in entries for x in v], dtype=np.int64))
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    out: list[dict[str, torch.Tensor]] = [{} for _ in hosts]
    for (j, name, _), t in zip(entries, flat.split([len(v) for _, _, v in entries])):
        out[j][name] = t
    return out


class _Group:
    """Requests lo..hi-1 of the batch (their catch-up rows: row_lo..row_hi-1 of the pass): the gather index of
    their working KV, the catch-up's query layout and mask, and the working K and V of each layer."""

    def __init__(self, caches: list[HeadKVCache], old: list[int], new: list[int], lo: int, row_lo: int, tail: int):
        # the host's part in Python (a batch is made every step, mostly of a few requests): lists of ints `bind`
        # turns into indices and masks on the device
        P = len(caches)
        committed = [o + n for o, n in zip(old, new)]
        self.lo, self.hi = lo, lo + P
        self.row_lo, self.row_hi = row_lo, row_lo + sum(new)
        self.Lc = Lc = max(committed)
        width = Lc + tail
        self.padded = min(committed) < Lc
        self.width = width
        pages = -(-width // PAGE)
        self.host = {}
        held = caches[0].pages[:pages]
        if P == 1 and len(held) == pages and held[-1] - held[0] == pages - 1 and held == sorted(held):
            # one request whose rows (and room for the drafts: HeadBatch reserves it) lie in consecutive pages:
            # its working KV is a view of the pool (the drafts are written past its committed rows)
            self.first_row = held[0] * PAGE
        else:
            self.first_row = None
            # [P * pages] each request's pages (past its own: page 0, any row: masked)
            self.host["pages"] = [p for c in caches for p in c.pages[:pages] + [0] * (pages - len(c.pages[:pages]))]
        if self.padded:
            self.host["committed"] = committed
        self._catch_up_layout(old, new)
        self.k: dict[int, torch.Tensor] = {}  # layer -> [P, Lc + tail, kv_heads, hd] (kept while drafts follow)
        self.v: dict[int, torch.Tensor] = {}
        self.draft_mask: Optional[torch.Tensor] = None  # [P, 1, rows, Lc + depth * rows]

    def _catch_up_layout(self, old: list[int], new: list[int]) -> None:
        host = self.host
        steady = [n <= LONG for n in new]
        self.n = n_max = max((n for n, s in zip(new, steady) if s), default=0)
        starts = list(itertools.accumulate(new, initial=0))
        # long requests: (request, its rows a..b-1 of the group's, c0, c); `bind` puts their masks in place of c0
        self.long = []
        for i, (o, n, s) in enumerate(zip(old, new, steady)):
            if not s:
                self.long.append((i, starts[i], starts[i + 1], o, o + n))
        if not n_max:
            return
        # query slot j of request i: its row min(j, n_i - 1) (padding repeats the last; a long request's: its first)
        slots = [[min(j, n - 1) if s else 0 for j in range(n_max)] for n, s in zip(new, steady)]
        if self.long or min(new) != n_max:
            # [P * n_max] each slot's row of the group; [rows] each row's slot
            host["q_src"] = [start + j for start, row in zip(starts, slots) for j in row]
            host["out_src"] = [i * n_max + j if s else 0 for i, (n, s) in enumerate(zip(new, steady)) for j in range(n)]
        if self.padded or n_max > 1 or self.long:
            # slot j of request i sits at column o_i + its row and sees the columns up to it (a long request's: all)
            host["row_col"] = [o + j if s else o + n - 1 for o, n, s, row in zip(old, new, steady, slots) for j in row]

    def bind(self, lists: dict[str, torch.Tensor], device) -> None:
        """The host's lists, now on the device -> the group's indices and masks."""
        P, Lc = self.hi - self.lo, self.Lc
        cols = torch.arange(max(self.width, PAGE), device=device)  # column numbers
        self.index = None  # [P * (Lc + tail)]: column c of request i -> its pool row (None: a view of the pool)
        if "pages" in lists:
            rows = lists["pages"].view(P, -1, 1) * PAGE + cols[:PAGE]  # [P, pages, PAGE]
            self.index = rows.view(P, -1)[:, :self.width].reshape(-1)
        # [P, 1, 1, Lc] the committed columns (None: no padding)
        self.keypad = (cols[:Lc] < lists["committed"].view(P, 1)).view(P, 1, 1, Lc) if self.padded else None
        self.q_src, self.out_src = lists.get("q_src"), lists.get("out_src")  # [P * n_max], [rows] or None
        self.catch_up_mask = None  # [P, 1, n_max, Lc]
        if "row_col" in lists:
            self.catch_up_mask = (cols[:Lc] <= lists["row_col"].view(P, self.n, 1)).unsqueeze(1)
        # long requests' masks: row j (column o + j) sees columns <= o + j (None: no rows before, plain causal)
        self.long = [(i, a, b, c, None if o == 0 else (cols[:c] <= cols[o:c].view(-1, 1)).view(1, 1, c - o, c))
                     for i, a, b, o, c in self.long]
        del self.host

    def catch_up(self, pool: HeadKVPool, layer: int, q: torch.Tensor, keep: bool) -> torch.Tensor:
        """q: [rows, heads, hd] the group's catch-up queries (their K and V already in the pool) -> [rows, heads,
        hd]. Gathers the layer's working KV (kept for the draft depths when `keep`)."""
        P, Lc = self.hi - self.lo, self.Lc
        if self.index is None:
            k = pool.k[layer].narrow(0, self.first_row, self.width).unsqueeze(0)  # [1, Lc + tail, kv_heads, hd]
            v = pool.v[layer].narrow(0, self.first_row, self.width).unsqueeze(0)
        else:
            k = pool.k[layer].index_select(0, self.index).view(P, -1, *pool.shape)  # [P, Lc + tail, kv_heads, hd]
            v = pool.v[layer].index_select(0, self.index).view(P, -1, *pool.shape)
        if keep:
            self.k[layer], self.v[layer] = k, v
        out = None
        if self.n:
            qp = q if self.q_src is None else q.index_select(0, self.q_src)  # [P * n_max, heads, hd]
            out = _attention(qp.view(P, self.n, *q.shape[1:]), k.narrow(1, 0, Lc), v.narrow(1, 0, Lc),
                             self.catch_up_mask)
            out = out.reshape(P * self.n, *q.shape[1:])
            if self.out_src is not None:
                out = out.index_select(0, self.out_src)
        if self.long:
            out = q.new_empty(q.shape) if out is None else out
            for i, a, b, c, mask in self.long:
                if mask is None:  # no rows before: plain causal
                    out[a:b] = _kernel(q[a:b].unsqueeze(0).transpose(1, 2), k[i:i + 1, :c].transpose(1, 2),
                                       v[i:i + 1, :c].transpose(1, 2), causal=True,
                                       gqa=q.shape[1] != k.shape[2])[0].transpose(0, 1)
                else:
                    out[a:b] = _attention(q[a:b].unsqueeze(0), k[i:i + 1, :c], v[i:i + 1, :c], mask)[0]
        return out

    def set_depth(self, depth: int, width: int, ancestors: Optional[torch.Tensor]) -> None:
        """The mask of depth `depth`'s rows: ancestors [P, width, depth * width] over the draft columns (None: a
        chain, width 1, every earlier depth)."""
        P, Lc = self.hi - self.lo, self.Lc
        if ancestors is None:
            self.draft_mask = F.pad(self.keypad, (0, depth), value=True) if self.padded else None
        elif self.padded:
            self.draft_mask = torch.cat([self.keypad.expand(P, 1, width, Lc), ancestors.unsqueeze(1)], dim=3)
        else:
            self.draft_mask = F.pad(ancestors.unsqueeze(1), (Lc, 0), value=True)

    def draft(self, layer: int, col: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [P * width, heads, hd]; k, v [P * width, kv_heads, hd]: the group's rows of a depth, written at draft
        column `col` (past Lc) -> [P * width, heads, hd]."""
        P, Lc = self.hi - self.lo, self.Lc
        rows = q.shape[0] // P
        wk, wv = self.k[layer], self.v[layer]
        wk.narrow(1, Lc + col, rows).copy_(k.view(P, rows, *k.shape[1:]))
        wv.narrow(1, Lc + col, rows).copy_(v.view(P, rows, *v.shape[1:]))
        end = Lc + col + rows
        out = _attention(q.view(P, rows, *q.shape[1:]), wk.narrow(1, 0, end), wv.narrow(1, 0, end), self.draft_mask)
        return out.reshape(P * rows, *q.shape[1:])


class HeadBatch:
    """The requests of one propose call: caches[i] gets rows[i] >= 1 catch-up rows (tokens: their input tokens,
    flat, on the host), then up to `draft_steps` depths of `width` draft rows each."""

    def __init__(self, pool: HeadKVPool, caches: list[HeadKVCache], rows: list[int], tokens: list[int],
                 draft_steps: int = 0, width: int = 1):
        self.pool, self.caches, self.rows, self.tokens = pool, caches, rows, tokens
        self.draft_steps, self.width = draft_steps, width
        old = [c.length for c in caches]
        positions, dest, roots = [], [], []
        tail = draft_steps * width
        for cache, o, n in zip(caches, old, rows):
            cache.reserve(n + tail)  # room for the drafts too: a batch of one may write them in place
            positions.extend(range(cache.start + o, cache.start + o + n))
            dest.extend(cache.pool_rows(o, o + n))
            roots.append(cache.start + o + n)  # Q: depth d's rows sit at Q + d - 1
        draft_positions = [q + d for d in range(draft_steps) for q in roots for _ in range(width)]
        host = {"input_ids": tokens,  # [T]
                "catch_up_positions": positions,  # [T]
                "dest": dest,  # [T] the catch-up rows' pool rows
                "last": [end - 1 for end in itertools.accumulate(rows)],  # [P] each request's last row (Q - 1)
                "draft_positions": draft_positions}  # [draft_steps * P * width]
        self.groups = self._groups(caches, old, rows, tail)
        device, *groups = _send([host] + [g.host for g in self.groups], pool.device)
        for g, lists in zip(self.groups, groups):
            g.bind(lists, pool.device)
        self.input_ids, self.catch_up_positions = device["input_ids"], device["catch_up_positions"]
        self.dest, self.last = device["dest"], device["last"]
        # per depth [P * width]
        self.draft_positions = device["draft_positions"].split(len(caches) * width) if draft_steps else ()
        self.depth = 0
        self.committed = False

    @staticmethod
    def _groups(caches, old, rows, tail) -> list[_Group]:
        groups, lo, row = [], 0, 0
        while lo < len(caches):
            hi, longest, total = lo, 0, 0
            while hi < len(caches):
                L = old[hi] + rows[hi] + tail
                if hi > lo and (hi - lo + 1) * max(longest, L) > max(2 * (total + L), SLACK):
                    break
                longest, total, hi = max(longest, L), total + L, hi + 1
            groups.append(_Group(caches[lo:hi], old[lo:hi], rows[lo:hi], lo, row, tail))
            lo, row = hi, row + sum(rows[lo:hi])
        return groups

    @property
    def positions(self) -> torch.Tensor:
        """The current pass's positions: [T] the catch-up's, [P * width] a depth's."""
        return self.catch_up_positions if self.depth == 0 else self.draft_positions[self.depth - 1]

    def set_depth(self, depth: int, ancestors: Optional[torch.Tensor] = None) -> None:
        """The next pass: depth d >= 1 (after the catch-up); ancestors [P, width, d * width] bool for a tree."""
        if not self.committed or not 1 <= depth <= self.draft_steps:
            raise ValueError(f"depth {depth} of a batch with {self.draft_steps} draft steps, after its catch-up")
        self.depth = depth
        for g in self.groups:
            g.set_depth(depth, self.width, None if ancestors is None else ancestors[g.lo:g.hi])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's attention of the current pass: q [R, heads, hd], k, v [R, kv_heads, hd] -> [R, heads, hd]."""
        if self.depth == 0:
            self.pool.k[layer].index_copy_(0, self.dest, k)
            self.pool.v[layer].index_copy_(0, self.dest, v)
            keep = self.draft_steps > 0
            if len(self.groups) == 1:
                return self.groups[0].catch_up(self.pool, layer, q, keep)
            return torch.cat([g.catch_up(self.pool, layer, q.narrow(0, g.row_lo, g.row_hi - g.row_lo), keep)
                              for g in self.groups])
        w, col = self.width, (self.depth - 1) * self.width
        if len(self.groups) == 1:
            return self.groups[0].draft(layer, col, q, k, v)
        return torch.cat([g.draft(layer, col, *(t.narrow(0, g.lo * w, (g.hi - g.lo) * w) for t in (q, k, v)))
                          for g in self.groups])

    def commit(self) -> None:
        """The catch-up ran: its rows are the caches' (host bookkeeping only)."""
        row = 0
        for cache, n in zip(self.caches, self.rows):
            cache.length += n
            cache.tokens.extend(self.tokens[row:row + n])
            row += n
        self.committed = True
