"""RadixCache: a radix tree over token ids whose edges carry the KV slots of those tokens (page size 1)."""

from __future__ import annotations

import heapq
import itertools
from typing import Optional, Sequence

import torch

from braid.runtime.mem_cache.base import PrefixCache

__all__ = ["TreeNode", "RadixCache"]

_node_ids = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(self, key: list[int], value: Optional[torch.Tensor], parent: Optional["TreeNode"],
                 last_access: int):
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token
        self.parent = parent
        self.key = key  # token ids of the edge into this node
        self.value = value  # [len(key)] int64 KV slots
        self.lock_ref = 0
        self.last_access = last_access
        self.id = next(_node_ids)

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


def _as_list(key: Sequence[int]) -> list[int]:
    return key if isinstance(key, list) else list(key)


class RadixCache(PrefixCache):
    disabled = False

    def __init__(self, req_to_token_pool, token_to_kv_pool):
        super().__init__(req_to_token_pool, token_to_kv_pool)
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
                self.token_to_kv_pool.free(torch.cat([node.value for node in nodes]))
            for node in nodes:
                node.parent = None
        self.root_node = TreeNode([], self._empty_slots(), None, self._clock)
        self.root_node.lock_ref = 1  # the root is never evicted
        self._evictable_size = 0
        self._protected_size = 0

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

    def total_size(self) -> int:
        return sum(len(node.key) for node in self._iter_nodes())

    # ---- tree operations ----
    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut child's edge after k tokens; the new node takes the first k and becomes child's parent."""
        head = TreeNode(child.key[:k], child.value[:k], child.parent, child.last_access)
        head.lock_ref = child.lock_ref
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

    def match_prefix(self, key: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        _, values, node = self._walk(_as_list(key), self._tick())
        if not values:
            return self._empty_slots(), node
        return (values[0].clone() if len(values) == 1 else torch.cat(values)), node

    def insert(self, key: Sequence[int], value: torch.Tensor) -> tuple[int, torch.Tensor, TreeNode]:
        """Cache key -> value (int64 slots, len(key) of them).

        Returns (prefix_len, slots, node). The first prefix_len tokens were cached already and keep the
        tree's slots: value[:prefix_len], where it differs from slots, is the caller's to free. The rest
        adopt value's slots (the tree keeps slices of value: do not write to it afterwards). slots are
        the tree's slots for the whole key; node covers exactly key.
        """
        key = _as_list(key)
        if len(key) != value.numel():
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        prefix_len, values, node = self._walk(key, self._tick())
        if prefix_len < len(key):
            leaf = TreeNode(key[prefix_len:], value[prefix_len:], node, node.last_access)
            node.children[leaf.key[0]] = leaf
            self._evictable_size += len(leaf.key)
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
            n.lock_ref += 1

    def dec_lock_ref(self, node: Optional[TreeNode]) -> None:
        path = self._path_to_root(node)
        if path and path[0].lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on an unlocked node {path[0]}")
        for n in path:
            if n.lock_ref == 1:
                self._evictable_size += len(n.key)
                self._protected_size -= len(n.key)
            n.lock_ref -= 1

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [node for node in self._iter_nodes() if not node.children and node.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        values: list[torch.Tensor] = []
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None  # detached: locking it now is an error
            values.append(node.value)
            freed += len(node.key)
            self._evictable_size -= len(node.key)
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        if values:
            self.token_to_kv_pool.free(torch.cat(values))
        return freed

    # ---- request hand-over ----
    def _insert_committed(self, req) -> tuple[torch.Tensor, TreeNode]:
        """Insert the request's committed tokens, free its slots the tree already had; return the tree's slots."""
        length = req.kv_committed_len
        if length > len(req.fill_ids):
            raise ValueError(f"kv_committed_len {length} exceeds the {len(req.fill_ids)} fill_ids")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, :length]
        own = row.to(device=self.token_to_kv_pool.device, dtype=torch.int64, copy=True)
        prefix_len, slots, node = self.insert(req.fill_ids[:length], own)
        if prefix_len:
            # Positions the request already shared with the tree hold equal slots; the others are duplicates.
            head, tree_head = own[:prefix_len], slots[:prefix_len]
            self.token_to_kv_pool.free(head[head != tree_head])
        return slots, node

    def cache_finished_req(self, req) -> None:
        if req.req_pool_idx is None:
            raise RuntimeError(f"request {getattr(req, 'rid', '?')} has no req_to_token row to release")
        self._insert_committed(req)
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None

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
