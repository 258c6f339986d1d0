"""Waiting-queue order: lpm (longest cached prefix first) or fcfs."""

from __future__ import annotations


def max_prefix_len(req) -> int:
    """How much of fill_ids may come from the cache: at least one token must run through the model (it yields the
    next-token logits), and prompt logprobs from logprob_start_len need the logits of the tokens before it."""
    limit = len(req.fill_ids) - 1
    if req.return_logprob and req.logprob_start_len >= 0 and req.input_token_logprobs is None:
        limit = min(limit, max(req.logprob_start_len - 1, 0))
    return max(limit, 0)


def order_waiting(waiting: list, policy: str, tree_cache) -> list:
    """Sets req.prefix_indices / req.last_node from the cache for requests not holding KV, returns the queue in order."""
    for req in waiting:
        if req.req_pool_idx is None:
            req.fill_ids = req.input_ids + req.output_ids
            key = req.fill_ids[: max_prefix_len(req)]
            req.prefix_indices, req.last_node = tree_cache.match_prefix(key)
    if policy == "lpm" and not tree_cache.disabled and len(waiting) < 256:
        # stable sort: equal prefixes keep arrival order
        return sorted(waiting, key=lambda r: -len(r.prefix_indices))
    return list(waiting)
