"""Waiting-queue orders beside lpm and fcfs (prefill.py): SGLang v0.3's `dfs-weight` and `random`.

dfs-weight: every waiting request sits at the radix-tree node where its cached prefix ends. A node's weight is the
number of waiting requests at it or below it. The order walks the tree depth first from the root, heavier
subtrees first, and emits a node's own requests after those of its subtrees; requests that share a prefix are
admitted together, the largest group first, so the prefix is computed (or kept) once for all of them.
"""

from __future__ import annotations

import random
from typing import Optional

from braid.runtime.core import Req


def dfs_weight_order(waiting: list[Req], root) -> list[Req]:
    """`waiting` (each request's `last_node` set by match_prefix) in dfs-weight order; ties keep arrival order."""
    at_node: dict[object, list[Req]] = {}
    for req in waiting:
        at_node.setdefault(req.last_node if req.last_node is not None else root, []).append(req)
    weight: dict[object, int] = {}
    for node, reqs in at_node.items():
        while node is not None:  # only the paths from these nodes to the root, not the whole tree
            weight[node] = weight.get(node, 0) + len(reqs)
            node = node.parent
    order: list[Req] = []
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:  # iterative: a tree can be deeper than Python's recursion limit
        node, children_done = stack.pop()
        if children_done:
            order.extend(at_node.get(node, ()))
            continue
        stack.append((node, True))
        children = sorted((c for c in node.children.values() if c in weight), key=lambda c: -weight[c])
        stack.extend((child, False) for child in reversed(children))
    if len(order) < len(waiting):  # a node no longer under the root (cannot happen within one step): keep them
        placed = {id(r) for r in order}
        order.extend(r for r in waiting if id(r) not in placed)
    return order


class RandomOrder:
    """`random`: the waiting queue shuffled each time it is ordered, from a generator seeded with --random-seed, so
    every tensor-parallel rank (which runs the same schedule) draws the same order."""

    def __init__(self, seed: Optional[int]):
        self.rng = random.Random(seed)

    def __call__(self, waiting: list[Req]) -> list[Req]:
        shuffled = list(waiting)
        self.rng.shuffle(shuffled)
        return shuffled
