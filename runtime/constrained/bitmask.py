"""Packed token bitmasks on the host: one int32 row of ceil(V / 32) words per request, bit t % 32 of word t // 32
set when token t is allowed. Engines fill rows; the sampler applies them on the device (layers/token_bitmask.py)."""

from __future__ import annotations

import torch

from braid.runtime.layers.token_bitmask import unpack_token_bitmask


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int, *, pin: bool = False) -> torch.Tensor:
    """[batch_size, words] int32, every token allowed."""
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def ids_to_bitmask_row(token_ids, vocab_size: int) -> torch.Tensor:
    """[words] int32 with exactly `token_ids` set."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    bits = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.bool)
    bits[ids] = True
    return pack_bool(bits.view(1, -1))[0]


def pack_bool(allowed: torch.Tensor) -> torch.Tensor:
    """allowed: [B, words * 32] bool -> [B, words] int32."""
    B = allowed.shape[0]
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (allowed.view(B, -1, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_row(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """row: [words] int32 -> sorted int64 ids of the allowed tokens below vocab_size."""
    return unpack_token_bitmask(row.view(1, -1), vocab_size)[0].nonzero().squeeze(1)


def clear_tokens(row: torch.Tensor, token_ids) -> None:
    """Clear `token_ids` in `row` ([words] int32) in place."""
    for t in token_ids:
        word = int(row[t // 32]) & 0xFFFFFFFF & ~(1 << (t % 32))
        row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word
