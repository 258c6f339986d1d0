"""Vectorized sampling over a batch: penalties, vocab masks, greedy/temperature/top-k/top-p/min-p, seeds.

`SamplingBatchInfo` is built once per batch composition on the host and moved to the device with pinned,
non-blocking copies; a chained decode step reuses it (`filter` drops the rows of requests that left). A batch
that is all greedy without penalties or masks builds no tensors at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from braid.runtime.layers.argmax_kernels import argmax_last_dim
from braid.runtime.layers.race_sampling import race_draw, random_keys, seeded_keys
from braid.runtime.layers.token_bitmask import apply_token_bitmask_, unpack_token_bitmask
from braid.runtime.core import host_to_device as _to_device


@dataclass
class SamplingBatchInfo:
    is_greedy: list[bool]
    all_greedy: bool
    # seeded requests (None when no row has a seed): a row's draw is keyed by (seed, seed_steps) (race_sampling)
    seeds: Optional[torch.Tensor] = None  # [B] int64 (0 for unseeded rows)
    seeded: Optional[torch.Tensor] = None  # [B] bool
    seed_steps: Optional[torch.Tensor] = None  # [B] int64, tokens each request has sampled; +1 per draw
    # None when all_greedy
    temperatures: Optional[torch.Tensor] = None  # [B, 1] fp32 (0 -> greedy)
    top_ps: Optional[torch.Tensor] = None  # [B] fp32
    top_ks: Optional[torch.Tensor] = None  # [B] int64 (vocab size when disabled)
    min_ps: Optional[torch.Tensor] = None  # [B] fp32
    need_top_k_filter: bool = False
    need_top_p_filter: bool = False
    need_min_p_filter: bool = False
    # penalties (None when no request in the batch uses them)
    frequency_penalties: Optional[torch.Tensor] = None  # [B, 1]
    presence_penalties: Optional[torch.Tensor] = None  # [B, 1]
    repetition_penalties: Optional[torch.Tensor] = None  # [B, 1]
    output_counts: Optional[torch.Tensor] = None  # [B, V] int32, counts of each token in the output so far
    seen_tokens: Optional[torch.Tensor] = None  # [B, V] bool, tokens in prompt or output (repetition penalty)
    # [B, ceil(V / 32)] int32 on the device, bit set = allowed (grammar masks, min_new_tokens bans)
    token_bitmask: Optional[torch.Tensor] = None
    # set per step by the scheduler, called by the runner once the model's pass is queued: -> token_bitmask (the
    # host's mask work runs while the device computes the logits)
    fill_token_bitmask: Optional[Callable[[], torch.Tensor]] = None
    # per-request static logit edits (None when no request in the batch has them)
    logit_bias: Optional[torch.Tensor] = None  # [B, V] fp32, added to the logits
    allowed_tokens: Optional[torch.Tensor] = None  # [B, V] bool, True = allowed_token_ids (all True for rows without)
    # logprobs of the sampled tokens: None = not wanted; else how many top alternatives (max over the batch)
    logprob_top_k: Optional[int] = None

    @classmethod
    def build(cls, reqs, vocab_size: int, device: torch.device) -> "SamplingBatchInfo":
        params = [r.sampling_params for r in reqs]
        is_greedy = [p.is_greedy for p in params]
        want_lp = [r.top_logprobs_num for r in reqs if r.return_logprob]
        info = cls(is_greedy=is_greedy, all_greedy=all(is_greedy), logprob_top_k=max(want_lp) if want_lp else None)
        B = len(reqs)
        # one pass finds whether any request needs more than temperature/top-k/top-p/min-p (the common batch: none)
        if not any(p.seed is not None or p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
                   or p.logit_bias or p.allowed_token_ids for p in params):
            if not info.all_greedy:
                info._set_sampling_tensors(params, vocab_size, device)
            return info
        if any(p.seed is not None and not p.is_greedy for p in params):
            info.seeds = _to_device([p.seed or 0 for p in params], torch.int64, device)
            info.seeded = _to_device([p.seed is not None for p in params], torch.bool, device)
            info.seed_steps = _to_device([len(r.output_ids) for r in reqs], torch.int64, device)
        if not info.all_greedy:
            info._set_sampling_tensors(params, vocab_size, device)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            counts = torch.zeros(B, vocab_size, dtype=torch.int32, device=device)
            for i, r in enumerate(reqs):
                if r.output_ids:
                    ids = torch.tensor(r.output_ids, dtype=torch.int64, device=device)
                    counts[i].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            info.output_counts = counts
            info.frequency_penalties = _to_device([p.frequency_penalty for p in params], torch.float32, device).view(B, 1)
            info.presence_penalties = _to_device([p.presence_penalty for p in params], torch.float32, device).view(B, 1)
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
            for i, r in enumerate(reqs):
                seen[i, torch.tensor(r.input_ids + r.output_ids, dtype=torch.int64, device=device)] = True
            info.seen_tokens = seen
            info.repetition_penalties = _to_device([p.repetition_penalty for p in params], torch.float32, device).view(B, 1)
        if any(p.logit_bias for p in params):
            rows = [i for i, p in enumerate(params) for _ in (p.logit_bias or ())]
            cols = [t for p in params for t in (p.logit_bias or ())]
            values = [float(v) for p in params for v in (p.logit_bias or {}).values()]
            info.logit_bias = torch.zeros(B, vocab_size, dtype=torch.float32, device=device).index_put_(
                (_to_device(rows, torch.int64, device), _to_device(cols, torch.int64, device)),
                _to_device(values, torch.float32, device))
        if any(p.allowed_token_ids for p in params):
            restricted = [i for i, p in enumerate(params) if p.allowed_token_ids]
            rows = [i for i in restricted for _ in params[i].allowed_token_ids]
            cols = [t for i in restricted for t in params[i].allowed_token_ids]
            allowed = torch.ones(B, vocab_size, dtype=torch.bool, device=device)
            allowed[_to_device(restricted, torch.int64, device)] = False
            info.allowed_tokens = allowed.index_put_(
                (_to_device(rows, torch.int64, device), _to_device(cols, torch.int64, device)),
                torch.ones(len(rows), dtype=torch.bool, device=device))
        return info

    def _set_sampling_tensors(self, params: list, vocab_size: int, device: torch.device) -> None:
        """temperatures, top_ps, top_ks, min_ps and their filter flags (a batch that is not all greedy)."""
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        self.temperatures = _to_device([max(p.temperature, 0.0) for p in params], torch.float32, device).view(
            len(params), 1)
        self.top_ps = _to_device([p.top_p for p in params], torch.float32, device)
        self.top_ks = _to_device(top_ks, torch.int64, device)
        self.min_ps = _to_device([p.min_p for p in params], torch.float32, device)
        self.need_top_k_filter = any(k < vocab_size for k in top_ks)
        self.need_top_p_filter = any(p.top_p < 1.0 for p in params)
        self.need_min_p_filter = any(p.min_p > 0.0 for p in params)

    def filter(self, keep: list[int], keep_on_device: Optional[torch.Tensor]) -> "SamplingBatchInfo":
        """The rows `keep` (keep_on_device: the same indices as an int64 tensor, None when all greedy)."""
        out = replace(self, is_greedy=[self.is_greedy[i] for i in keep], token_bitmask=None, fill_token_bitmask=None)
        for name in ("seeds", "seeded", "seed_steps", "temperatures", "top_ps", "top_ks", "min_ps",
                     "frequency_penalties", "presence_penalties",
                     "repetition_penalties", "output_counts", "seen_tokens", "logit_bias", "allowed_tokens"):
            t = getattr(self, name)
            if t is not None:
                setattr(out, name, t.index_select(0, keep_on_device))
        return out


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """logits: [B, V] fp32 -> the logits to sample from (`logits` itself may be masked in place unless logprobs are
    wanted)."""
    original = logits
    if info.logit_bias is not None:
        logits = logits + info.logit_bias
    if info.output_counts is not None:
        counts = info.output_counts.to(logits.dtype)
        logits = logits - info.frequency_penalties * counts - info.presence_penalties * (counts > 0).to(logits.dtype)
    if info.seen_tokens is not None:
        penalized = torch.where(logits > 0, logits / info.repetition_penalties, logits * info.repetition_penalties)
        logits = torch.where(info.seen_tokens, penalized, logits)
    bitmask = info.token_bitmask
    if info.allowed_tokens is not None:
        mask = info.allowed_tokens
        if bitmask is not None:  # a min_new_tokens ban that would leave a row nothing keeps allowed_token_ids alone
            both = unpack_token_bitmask(bitmask, logits.shape[1]) & mask
            mask = torch.where(both.any(dim=-1, keepdim=True), both, mask)
        return logits.masked_fill(~mask, float("-inf"))
    if bitmask is not None:
        if info.logprob_top_k is not None and logits is original:
            logits = logits.clone()  # logprobs are read from the unmasked logits
        apply_token_bitmask_(logits, bitmask)
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits: [B, V] fp32 (already penalized/masked) -> token ids [B] int64."""
        if info.all_greedy:
            return argmax_last_dim(logits)
        inv_temps = 1.0 / info.temperatures.view(-1).clamp_min(1e-5)
        if info.need_top_k_filter or info.need_top_p_filter or info.need_min_p_filter:
            probs = self._filter(torch.softmax(logits * inv_temps.view(-1, 1), dim=-1), info)
            sampled = race_draw(probs.log(), torch.ones_like(inv_temps), self._keys(info, logits.shape[0]))
        else:
            sampled = race_draw(logits, inv_temps, self._keys(info, logits.shape[0]))
        if info.seed_steps is not None:
            info.seed_steps.add_(1)
        if not any(info.is_greedy):
            return sampled
        greedy_mask = (info.temperatures.view(-1) <= 0) | (info.top_ks == 1)
        return torch.where(greedy_mask, argmax_last_dim(logits), sampled)

    @staticmethod
    def _keys(info: SamplingBatchInfo, rows: int) -> torch.Tensor:
        """[B, 2] int64: seeded rows keyed by (seed, tokens sampled so far), the others by torch's RNG."""
        keys = random_keys(rows, info.temperatures.device)
        if info.seeds is None:
            return keys
        return torch.where(info.seeded.view(-1, 1), seeded_keys(info.seeds, info.seed_steps), keys)

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
