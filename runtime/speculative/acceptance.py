"""The acceptance rule of speculative decoding, for chain drafts from a deterministic proposer (n-gram lookup, EAGLE's
greedy chains: the draft distribution is a point mass on the proposed token); draft_tree.walk applies it to trees.

At each verified position the target's distribution p is the one the request would sample from without speculation
(penalties, logit bias, the grammar mask, temperature, top-k / top-p / min-p applied). Draft token d is accepted
with probability p(d); at the first rejection the emitted token is drawn from p with d removed and renormalised,
and after a fully accepted draft one more token is drawn from the next position's p. Each emitted token is then
distributed exactly as p (P(d) = p(d); P(t != d) = (1 - p(d)) * p(t) / (1 - p(d)) = p(t)). A greedy row's p is the
one-hot of its argmax, so the rule reduces to "accept while the draft equals the argmax".
"""

from __future__ import annotations

from typing import Optional

import torch

from braid.runtime.layers.argmax_kernels import argmax_last_dim
from braid.runtime.layers.sampler import Sampler


def target_probs(logits: torch.Tensor, info) -> torch.Tensor:
    """logits: [T, V] fp32, penalized and masked (apply_penalties); info: SamplingBatchInfo with one row per
    logits row -> [T, V] fp32 distributions, each row summing to 1 (greedy rows one-hot at their argmax)."""
    T, V = logits.shape
    greedy = torch.tensor(info.is_greedy, dtype=torch.bool, device=logits.device)
    onehot = torch.zeros(T, V, dtype=torch.float32, device=logits.device)
    onehot.scatter_(1, argmax_last_dim(logits).view(-1, 1), 1.0)
    if info.all_greedy:
        return onehot
    inv_temps = 1.0 / info.temperatures.view(-1, 1).clamp_min(1e-5)
    probs = torch.softmax(logits * inv_temps, dim=-1)
    if info.need_top_k_filter or info.need_top_p_filter or info.need_min_p_filter:
        probs = Sampler._filter(probs, info)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.where(greedy.view(-1, 1), onehot, probs)


def accept(probs: torch.Tensor, row_start: list[int], drafts: list[list[int]], is_greedy: list[bool],
           generators: Optional[list[Optional[torch.Generator]]] = None) -> list[list[int]]:
    """probs: [T, V] target distributions; request i's rows are row_start[i] .. row_start[i] + len(drafts[i]), row j
    the distribution of the token after draft[:j] (row 0: after the request's last committed token).
    generators[i]: the request's own random stream (seeded requests), else torch's global one.
    -> per request the tokens to emit: the accepted prefix of its draft, then one token drawn by the rule above."""
    B = len(drafts)
    generators = generators or [None] * B
    dev = probs.device
    n_accepted = [0] * B
    flat_rows = [row_start[i] + j for i in range(B) for j in range(len(drafts[i]))]
    if flat_rows:
        rows = torch.tensor(flat_rows, dtype=torch.int64, device=dev)
        toks = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=dev)
        p_draft = probs[rows, toks]  # [D]
        ok = (acceptance_uniforms([len(d) for d in drafts], generators, dev) < p_draft).tolist()
        offset = 0
        for i, d in enumerate(drafts):
            n = 0
            while n < len(d) and ok[offset + n]:
                n += 1
            n_accepted[i] = n
            offset += len(d)
    rejected = [[drafts[i][n_accepted[i]]] if n_accepted[i] < len(drafts[i]) else [] for i in range(B)]
    final = draw_final(probs, [row_start[i] + n_accepted[i] for i in range(B)], rejected, is_greedy, generators)
    return [drafts[i][:n_accepted[i]] + [final[i]] for i in range(B)]


def acceptance_uniforms(counts: list[int], generators: list[Optional[torch.Generator]], device) -> torch.Tensor:
    """[sum(counts)] uniforms in [0, 1), request i's counts[i] in order: from its generator when it has one, else
    from torch's global stream (drawn for all at once)."""
    uniform = torch.rand(sum(counts), device=device)
    offset = 0
    for n, gen in zip(counts, generators):
        if gen is not None and n:
            uniform[offset:offset + n] = torch.rand(n, generator=gen).to(device)
        offset += n
    return uniform


def draw_final(probs: torch.Tensor, rows: list[int], rejected: list[list[int]], is_greedy: list[bool],
               generators: list[Optional[torch.Generator]]) -> list[int]:
    """The token each request emits after its accepted drafts: drawn from probs[rows[i]] ([T, V]) with the tokens
    rejected[i] (the drafts just rejected there) zeroed and renormalised; the argmax for greedy rows."""
    B = len(rows)
    dev = probs.device
    dist = probs.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev))  # [B, V]
    refused = [(i, t) for i in range(B) for t in rejected[i]]
    if refused:
        r = torch.tensor([i for i, _ in refused], dtype=torch.int64, device=dev)
        d = torch.tensor([t for _, t in refused], dtype=torch.int64, device=dev)
        residual = dist.clone()
        residual[r, d] = 0.0  # p without the rejected tokens (multinomial renormalises)
        # rejected tokens held all of p only if rounding made their p < 1 while nothing else has weight: keep p there
        dist = torch.where((residual.sum(dim=-1) > 0).view(-1, 1), residual, dist)
    final = argmax_last_dim(dist).tolist()
    sampled_rows = [i for i in range(B) if not is_greedy[i]]
    if sampled_rows:
        plain = [i for i in sampled_rows if generators[i] is None]
        if plain:
            idx = torch.tensor(plain, dtype=torch.int64, device=dev)
            for i, t in zip(plain, _draw(dist.index_select(0, idx)).tolist()):
                final[i] = t
        for i in sampled_rows:
            if generators[i] is not None:
                final[i] = int(_draw(dist[i:i + 1].cpu(), generators[i])[0])
    return final


def _draw(dist: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """dist: [N, V] non-negative weights, each row with some -> [N] int64 drawn in proportion."""
    return torch.multinomial(dist, 1, generator=generator).view(-1)
