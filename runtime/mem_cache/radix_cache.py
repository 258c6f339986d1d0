"""RadixCache: a radix tree over token ids whose edges carry the KV slots of those tokens (page size 1).

With a HybridKVPool (window_pool.py: window layers' KV released once out of every window), each node also records
`window_from`: its first window_from tokens hold no window-layer KV any more (what was released is always a node's
leading tokens, since windows only move forward). The rules that keep reuse correct:

* Matching: a cached prefix of m tokens is reused only when its last W - 1 tokens (all m when m < W) still hold
  window KV, W being the pool's window. Otherwise the match is cut back to the longest such prefix (a node start
  whose preceding W - 1 tokens hold it, or 0) and the rest is computed again, global layers included. In practice a
  finished request keeps the window KV of its last W - 1 tokens, so a conversation's next turn reuses all of it;
  a prefix shared only up to a point that a long request has already slid past (a system prompt under an 8K
  request) is a miss.
* Releasing: a request releases the window KV of a node's tokens below its own window only when it is the node's
  only locker (lock_ref 1); nodes shared with other running requests keep it until one of them is alone.
* Inserting a request's tokens that the tree already has: where the tree's copy lost its window KV and the
  request's still holds it, the request's window slots move to the tree's slots (the same tokens' KV), so a request
  that continues on the tree's slots keeps its window; the request's other duplicate window slots are released.
* Eviction frees a node's full slots and the window slots it still holds; the window space's evictable count
  (`window_evictable_size`) is part of `available_slots`.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional, Sequence

import torch

from braid.runtime.mem_cache.base import PrefixCache

__all__ = ["TreeNode", "RadixCache"]

_node_ids = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id", "window_from")

    def __init__(self, key: list[int], value: Optional[torch.Tensor], parent: Optional["TreeNode"],
                 last_access: int):
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token
        self.parent = parent
        self.key = key  # token ids of the edge into this node
        self.value = value  # [len(key)] int64 KV slots
        self.lock_ref = 0
        self.last_access = last_access
        self.id = next(_node_ids)
        self.window_from = 0  # hybrid pool: the first window_from tokens hold no window-layer KV

    @property
    def window_held(self) -> int:
        return len(self.key) - self.window_from

    def __lt__(self, other: "TreeNode") -> bool:
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, last_access={self.last_access})"


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    if edge[:n] == key[start:start + n]:
        return n
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


def _as_list(key: Sequence[int], namespace: Optional[str] = None) -> list:
    """The tree's key for token ids: with a namespace (a LoRA adapter's name) the first token becomes
    (namespace, token), so the namespace's paths leave the root on edges of their own and a prefix computed under
    one adapter never matches under another or the base model (None)."""
    key = key if isinstance(key, list) else list(key)
    if namespace is None or not key:
        return key
    return [(namespace, key[0]), *key[1:]]


class RadixCache(PrefixCache):
    disabled = False

    def __init__(self, req_to_token_pool, kv_pool):
        super().__init__(req_to_token_pool, kv_pool)
        self._clock = 0
        self.reset()

    # ---- bookkeeping ----
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def reset(self) -> None:
        root = getattr(self, "root_node", None)
        if root is not None:
            nodes = [node for node in self._iter_nodes() if node is not root]
            if nodes:
                self._free_nodes(nodes)
            for node in nodes:
                node.parent = None
        self.root_node = TreeNode([], self._empty_slots(), None, self._clock)
        self.root_node.lock_ref = 1  # the root is never evicted
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_window = 0
        self._protected_window = 0

    def _free_nodes(self, nodes: list[TreeNode]) -> None:
        """Give the nodes' full slots, and the window slots they still hold, back to the pool."""
        slots = torch.cat([node.value for node in nodes])
        if self.window_pool is None:
            self.kv_pool.free(slots)
            return
        held = [node.value[node.window_from:] for node in nodes if node.window_held]
        if held:
            self.window_pool.release_window(torch.cat(held))
        self.window_pool.free(slots, window_released=True)

    def _count_window(self, node: TreeNode, delta: int) -> None:
        if node.lock_ref > 0:
            self._protected_window += delta
        else:
            self._evictable_window += delta

    def _iter_nodes(self):
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def window_evictable_size(self) -> int:
        return self._evictable_window

    def window_protected_size(self) -> int:
        return self._protected_window

    def total_size(self) -> int:
        return sum(len(node.key) for node in self._iter_nodes())

    # ---- tree operations ----
    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut child's edge after k tokens; the new node takes the first k and becomes child's parent."""
        head = TreeNode(child.key[:k], child.value[:k], child.parent, child.last_access)
        head.lock_ref = child.lock_ref
        head.window_from = min(child.window_from, k)
        child.window_from = max(child.window_from - k, 0)
        head.children[child.key[k]] = child
        child.parent.children[child.key[0]] = head
        child.parent = head
        child.key = child.key[k:]
        child.value = child.value[k:]
        return head

    def _walk(self, key: list[int], now: int) -> tuple[int, list[torch.Tensor], TreeNode]:
        """Follow key as far as the tree has it, splitting an edge the match ends inside of."""
        node = self.root_node
        node.last_access = now
        pos = 0
        values: list[torch.Tensor] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            k = _common_prefix_len(child.key, key, pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            values.append(child.value)
            pos += k
            node = child
        return pos, values, node

    def match_prefix(self, key: Sequence[int], namespace: Optional[str] = None) -> tuple[torch.Tensor, TreeNode]:
        key = _as_list(key, namespace)
        matched, values, node = self._walk(key, self._tick())
        if self.window_pool is not None:
            usable = self._window_usable_len(node, matched)
            if usable < matched:
                matched, values, node = self._walk(key[:usable], self._clock)
        if not values:
            return self._empty_slots(), node
        return (values[0].clone() if len(values) == 1 else torch.cat(values)), node

    def _window_usable_len(self, node: TreeNode, matched: int) -> int:
        """The longest m <= matched whose last W - 1 tokens on the path to `node` hold window KV (see the module
        docstring)."""
        need = self.window_pool.window - 1
        spans = []  # (start position, end position, window_from) from the deepest node up
        end = matched
        while node is not self.root_node:
            spans.append((end - len(node.key), end, node.window_from))
            end -= len(node.key)
            node = node.parent
        usable = matched
        for start, _, window_from in spans:
            lacking_end = start + window_from  # positions [start, lacking_end) hold no window KV
            if lacking_end > usable - need and window_from:
                usable = min(usable, start)  # a cut inside [start, lacking_end] leaves released tokens in view
            if start < usable - need:
                break
        return max(usable, 0)

    def insert(self, key: Sequence[int], value: torch.Tensor, window_from: int = 0,
               namespace: Optional[str] = None) -> tuple[int, torch.Tensor, TreeNode]:
        """Cache key -> value (int64 slots, len(key) of them); with a hybrid pool, value's first window_from slots
        hold no window-layer KV.

        Returns (prefix_len, slots, node). The first prefix_len tokens were cached already and keep the
        tree's slots: value[:prefix_len], where it differs from slots, is the caller's to free. The rest
        adopt value's slots (the tree keeps slices of value: do not write to it afterwards). slots are
        the tree's slots for the whole key; node covers exactly key. namespace: see _as_list.
        """
        key = _as_list(key, namespace)
        if len(key) != value.numel():
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        prefix_len, values, node = self._walk(key, self._tick())
        if prefix_len < len(key):
            leaf = TreeNode(key[prefix_len:], value[prefix_len:], node, node.last_access)
            leaf.window_from = min(max(window_from - prefix_len, 0), len(leaf.key))
            node.children[leaf.key[0]] = leaf
            self._evictable_size += len(leaf.key)
            self._evictable_window += leaf.window_held
            values.append(leaf.value)
            node = leaf
        if not values:
            return 0, self._empty_slots(), node
        return prefix_len, torch.cat(values), node

    def _path_to_root(self, node: Optional[TreeNode]) -> list[TreeNode]:
        path = []
        while node is not None and node is not self.root_node:
            path.append(node)
            node = node.parent
        if path and node is None:
            raise RuntimeError(f"{path[0]} is no longer in the cache (evicted or reset); match the prefix again")
        return path

    def inc_lock_ref(self, node: Optional[TreeNode]) -> None:
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                self._evictable_size -= len(n.key)
                self._protected_size += len(n.key)
                self._evictable_window -= n.window_held
                self._protected_window += n.window_held
            n.lock_ref += 1

    def dec_lock_ref(self, node: Optional[TreeNode]) -> None:
        path = self._path_to_root(node)
        if path and path[0].lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on an unlocked node {path[0]}")
        for n in path:
            if n.lock_ref == 1:
                self._evictable_size += len(n.key)
                self._protected_size -= len(n.key)
                self._evictable_window += n.window_held
                self._protected_window -= n.window_held
            n.lock_ref -= 1

    def evict(self, num_tokens: int, num_window_tokens: int = 0) -> int:
        if num_tokens <= 0 and num_window_tokens <= 0:
            return 0
        heap = [node for node in self._iter_nodes() if not node.children and node.lock_ref == 0]
        heapq.heapify(heap)
        freed = freed_window = 0
        evicted: list[TreeNode] = []
        while (freed < num_tokens or freed_window < num_window_tokens) and heap:
            node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None  # detached: locking it now is an error
            evicted.append(node)
            freed += len(node.key)
            freed_window += node.window_held
            self._evictable_size -= len(node.key)
            self._evictable_window -= node.window_held
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        if evicted:
            self._free_nodes(evicted)
        return freed

    def drop_namespace(self, namespace: str) -> int:
        # a namespace's paths leave the root on edges keyed (namespace, first token): see _as_list
        tops = [child for key, child in self.root_node.children.items()
                if isinstance(key, tuple) and key[0] == namespace]
        nodes: list[TreeNode] = []
        stack = list(tops)
        while stack:
            node = stack.pop()
            if node.lock_ref:
                raise RuntimeError(f"drop_namespace({namespace!r}): {node} is locked by a running request")
            nodes.append(node)
            stack.extend(node.children.values())
        for top in tops:
            del self.root_node.children[top.key[0]]
        for node in nodes:
            self._evictable_size -= len(node.key)
            self._evictable_window -= node.window_held
        if nodes:
            self._free_nodes(nodes)
        for node in nodes:
            node.parent = None  # detached: locking it now is an error
        return sum(len(node.key) for node in nodes)

    # ---- request hand-over ----
    def _insert_committed(self, req) -> tuple[torch.Tensor, TreeNode]:
        """Insert the request's committed tokens, free its slots the tree already had; return the tree's slots."""
        length = req.kv_committed_len
        if length > len(req.fill_ids):
            raise ValueError(f"kv_committed_len {length} exceeds the {len(req.fill_ids)} fill_ids")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, :length]
        own = row.to(device=self.kv_pool.device, dtype=torch.int64, copy=True)
        own_lo = self._cache_owned_len(req)
        # hybrid pool: the request's own slots hold window KV from here on
        own_window_from = max(req.window_kv_from, own_lo) if self.window_pool is not None else 0
        prefix_len, slots, node = self.insert(req.fill_ids[:length], own, window_from=own_window_from,
                                              namespace=req.lora_path)
        if self.window_pool is not None and prefix_len > own_lo:
            self._merge_duplicate_window(node, prefix_len, length, own, own_lo, own_window_from)
            self.window_pool.free(own[own_lo:prefix_len], window_released=True)
        elif prefix_len > own_lo:
            # own[:own_lo] are the tree's slots (the request's locked prefix); own[own_lo:prefix_len] duplicate
            # tokens another request inserted meanwhile. Slicing, not comparing slots, keeps this free of a sync
            # with the device (a boolean mask waits for the step in flight).
            self.kv_pool.free(own[own_lo:prefix_len])
        return slots, node

    def _merge_duplicate_window(self, node: TreeNode, prefix_len: int, length: int, own: torch.Tensor,
                                own_lo: int, own_window_from: int) -> None:
        """Hybrid pool: the request's slots own[own_lo:prefix_len] duplicate tokens the tree had. Per tree node,
        window KV the tree released but the request holds moves to the tree's slots; the request's other window
        slots there are released (see the module docstring)."""
        if prefix_len < length:
            node = node.parent  # `node` is the new leaf; walk up from the last node the tree already had
        pool = self.window_pool
        end = prefix_len
        moved_src, moved_dst, released = [], [], []
        while node is not self.root_node and end > own_lo:
            start = end - len(node.key)
            lo = max(start, own_lo)
            lacking_end = start + node.window_from
            # positions [max(lo, own_window_from), lacking_end): the tree lacks window KV, the request holds it
            move_lo = max(lo, own_window_from)
            if move_lo < lacking_end:
                moved_src.append(own[move_lo:lacking_end])
                moved_dst.append(node.value[move_lo - start:lacking_end - start])
                self._count_window(node, lacking_end - move_lo)
                node.window_from = move_lo - start
            # positions [max(lo, lacking_end, own_window_from), end): both hold it; the request's copy goes
            dup_lo = max(lo, lacking_end, own_window_from)
            if dup_lo < end:
                released.append(own[dup_lo:end])
            end = start
            node = node.parent
        if moved_src:
            pool.transfer_window(torch.cat(moved_src), torch.cat(moved_dst))
        if released:
            pool.release_window(torch.cat(released))

    def _release_cached_window(self, req, until: int) -> list[torch.Tensor]:
        node = req.last_node
        if node is None or node is self.root_node:
            return []
        path = self._path_to_root(node)
        end = sum(len(n.key) for n in path)
        limit = min(until, self._cache_owned_len(req))
        out = []
        for n in path:  # deepest first
            start = end - len(n.key)
            stop = min(end, limit) - start
            if n.lock_ref == 1 and stop > n.window_from:
                out.append(n.value[n.window_from:stop])
                self._protected_window -= stop - n.window_from
                n.window_from = stop
            end = start
        return out

    def cache_finished_req(self, req) -> None:
        if req.req_pool_idx is None:
            raise RuntimeError(f"request {getattr(req, 'rid', '?')} has no req_to_token row to release")
        self.trim_window_kv([req], exact=True)  # keep only the last W - 1 tokens' window KV in the cache
        self._insert_committed(req)
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        if self.window_pool is not None:
            req.window_kv_from = 0

    def cache_unfinished_req(self, req) -> None:
        if req.req_pool_idx is None:
            raise RuntimeError(f"request {getattr(req, 'rid', '?')} has no req_to_token row")
        slots, node = self._insert_committed(req)
        if slots.numel():
            self.req_to_token_pool.req_to_token[req.req_pool_idx, : slots.numel()] = slots.to(torch.int32)
        self.inc_lock_ref(node)
        self.dec_lock_ref(req.last_node)
        req.last_node = node
        req.prefix_indices = slots
