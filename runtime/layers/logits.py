"""Logits from the final hidden states, and logprobs under the raw (unpenalized, unmasked) distribution."""

from __future__ import annotations

from typing import Optional

import torch

from braid.runtime.core import ForwardBatch


def last_token_rows(fb: ForwardBatch) -> Optional[torch.Tensor]:
    """[B] int64 rows of each request's last token in the pass's T rows (None at decode: every row is one)."""
    if fb.forward_mode.is_decode():
        return None
    return (fb.extend_start_loc + fb.extend_seq_lens - 1).long()


def compute_logits(lm_head, hidden: torch.Tensor, rows: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """hidden: [T, hidden]; rows: [N] int64 or None (all) -> [N, vocab_size] fp32."""
    picked = hidden if rows is None else hidden.index_select(0, rows)
    return lm_head(picked)[:, :vocab_size]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0):
    """logits [N, V], token_ids [N] -> (logprobs [N], top values [N, k], top ids [N, k]) from the raw distribution."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, token_ids.view(-1, 1)).view(-1)
    if top_k > 0:
        vals, ids = logp.topk(top_k, dim=-1)
        return chosen, vals, ids
    return chosen, None, None
