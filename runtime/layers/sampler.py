"""Vectorized sampling over a batch: penalties, grammar masks, greedy/temperature/top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B, 1] fp32 (0 -> greedy)
    top_ps: torch.Tensor  # [B] fp32
    top_ks: torch.Tensor  # [B] int64 (vocab size when disabled)
    min_ps: torch.Tensor  # [B] fp32
    is_greedy: list[bool]
    generators: list[Optional[torch.Generator]]  # per-request seeded generators (None: shared RNG)
    # penalties (None when no request in the batch uses them)
    frequency_penalties: Optional[torch.Tensor] = None  # [B, 1]
    presence_penalties: Optional[torch.Tensor] = None  # [B, 1]
    repetition_penalties: Optional[torch.Tensor] = None  # [B, 1]
    output_counts: Optional[torch.Tensor] = None  # [B, V] int32, counts of each token in the output so far
    seen_tokens: Optional[torch.Tensor] = None  # [B, V] bool, tokens in prompt or output (repetition penalty)
    # [B, V] bool: True = allowed (grammar masks, min_new_tokens bans); None when unconstrained
    vocab_mask: Optional[torch.Tensor] = None
    need_top_k_filter: bool = False
    need_top_p_filter: bool = False
    need_min_p_filter: bool = False

    @classmethod
    def build(cls, reqs, vocab_size: int, device: torch.device) -> "SamplingBatchInfo":
        params = [r.sampling_params for r in reqs]
        B = len(reqs)
        temps = torch.tensor([max(p.temperature, 0.0) for p in params], dtype=torch.float32, device=device).view(B, 1)
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        info = cls(
            temperatures=temps,
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            is_greedy=[p.is_greedy for p in params],
            generators=[r.generator for r in reqs],
            need_top_k_filter=any(k < vocab_size for k in top_ks),
            need_top_p_filter=any(p.top_p < 1.0 for p in params),
            need_min_p_filter=any(p.min_p > 0.0 for p in params),
        )
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            counts = torch.zeros(B, vocab_size, dtype=torch.int32, device=device)
            for i, r in enumerate(reqs):
                if r.output_ids:
                    ids = torch.tensor(r.output_ids, dtype=torch.int64, device=device)
                    counts[i].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            info.output_counts = counts
            info.frequency_penalties = torch.tensor([p.frequency_penalty for p in params], device=device).view(B, 1)
            info.presence_penalties = torch.tensor([p.presence_penalty for p in params], device=device).view(B, 1)
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
            for i, r in enumerate(reqs):
                ids = torch.tensor(r.input_ids + r.output_ids, dtype=torch.int64, device=device)
                seen[i, ids] = True
            info.seen_tokens = seen
            info.repetition_penalties = torch.tensor([p.repetition_penalty for p in params], device=device).view(B, 1)
        return info


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    if info.output_counts is not None:
        counts = info.output_counts.to(logits.dtype)
        logits = logits - info.frequency_penalties * counts - info.presence_penalties * (counts > 0).to(logits.dtype)
    if info.seen_tokens is not None:
        penalized = torch.where(logits > 0, logits / info.repetition_penalties, logits * info.repetition_penalties)
        logits = torch.where(info.seen_tokens, penalized, logits)
    if info.vocab_mask is not None:
        logits = logits.masked_fill(~info.vocab_mask, float("-inf"))
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits: [B, V] fp32 (already penalized/masked) -> token ids [B] int64."""
        if all(info.is_greedy):
            return logits.argmax(dim=-1)
        greedy_ids = logits.argmax(dim=-1)
        probs = torch.softmax(logits / info.temperatures.clamp_min(1e-5), dim=-1)
        if info.need_top_k_filter or info.need_top_p_filter or info.need_min_p_filter:
            probs = self._filter(probs, info)
        sampled = self._draw(probs, info.generators)
        greedy_mask = torch.tensor(info.is_greedy, device=logits.device)
        return torch.where(greedy_mask, greedy_ids, sampled)

    @staticmethod
    def _filter(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
        drop = ranks >= info.top_ks.view(-1, 1)
        if info.need_top_p_filter:
            cum = sorted_probs.cumsum(dim=-1)
            drop |= (cum - sorted_probs) > info.top_ps.view(-1, 1)
        if info.need_min_p_filter:
            drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps.view(-1, 1)
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)

    @staticmethod
    def _draw(probs: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if not seeded:
            return torch.multinomial(probs, 1).view(-1)
        out = torch.multinomial(probs, 1).view(-1) if len(seeded) < len(generators) else torch.empty(
            probs.shape[0], dtype=torch.int64, device=probs.device)
        for i in seeded:
            out[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
        return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0):
    """logits [N, V], token_ids [N] -> (logprobs [N], top values [N, k], top ids [N, k]) from the raw distribution."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, token_ids.view(-1, 1)).view(-1)
    if top_k > 0:
        vals, ids = logp.topk(top_k, dim=-1)
        return chosen, vals, ids
    return chosen, None, None
