"""Grammar masks on the device: logits of tokens whose bit is clear in a packed bitmask set to -inf, in place.

bitmask: [B, ceil(V / 32)] int32, bit t % 32 of word t // 32 set = token t allowed (the layout of
constrained/bitmask.py and llguidance). One Triton launch on CUDA; torch elsewhere.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["apply_token_bitmask_", "unpack_token_bitmask"]


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, V, logits_row_stride, words_per_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < V
    words = tl.load(bitmask_ptr + row.to(tl.int64) * words_per_row + offs // 32, mask=in_vocab, other=0)
    banned = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row.to(tl.int64) * logits_row_stride + offs, float("-inf"), mask=in_vocab & banned)


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 -> [B, vocab_size] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _banned(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 -> [B, vocab_size] bool (True = banned). On a little-endian host's CPU tensors numpy unpacks the
    words' bytes in token order, one byte a token, where the shift-and-mask of unpack_token_bitmask makes 32-bit
    intermediates per token."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        words = bitmask.contiguous().numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(words, axis=1, count=vocab_size, bitorder="little")) == 0
    return ~unpack_token_bitmask(bitmask, vocab_size)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, *, use_kernel: bool | None = None,
                         block: int = 4096) -> None:
    """logits: [B, V] (unit stride along V); bitmask: [B, >= ceil(V / 32)] int32 on the same device."""
    B, V = logits.shape
    if bitmask.shape[0] != B or bitmask.shape[1] * 32 < V:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
    if use_kernel is None:
        use_kernel = logits.is_cuda
    if not use_kernel:
        logits.masked_fill_(_banned(bitmask, V), float("-inf"))
        return
    if logits.stride(-1) != 1 or not bitmask.is_contiguous():
        raise ValueError("apply_token_bitmask_ needs unit stride along V and a contiguous bitmask")
    _apply_token_bitmask_kernel[(B, triton.cdiv(V, block))](logits, bitmask, V, logits.stride(0), bitmask.shape[1],
                                                            BLOCK=block)
