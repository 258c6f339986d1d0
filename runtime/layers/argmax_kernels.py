"""Greedy sampling's argmax over the vocabulary as two Triton kernels (CUDA).

torch.argmax over one [1, V] row reduces in a single thread block at Llama-3's V = 128,256: 27 us of an H200 decode
step (decode_step_kernels.py), where reading the 0.5 MB row takes well under 1 us. Here stage 1 gives every
BLOCK-wide chunk of a row its own program (max and first index of the max), stage 2 picks the first chunk holding
the row's max, so the result is torch.argmax's: the first index of the maximum (NaN counted as +inf).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["argmax_last_dim", "chunked_argmax", "row_argmax_of_chunks_kernel"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _chunk_argmax_kernel(x_ptr, max_ptr, idx_ptr, V, x_row_stride, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax (where it also beats +inf)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + at)


@triton.jit
def row_argmax_of_chunks_kernel(max_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    maxima = tl.load(max_ptr + row * num_chunks + offs, mask=offs < num_chunks, other=float("-inf"))
    _, chunk = tl.max(maxima, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + chunk).to(tl.int64))


def argmax_last_dim(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> int64 [B], equal to logits.argmax(dim=-1): the kernels for CUDA tensors with unit stride
    along V, torch.argmax otherwise."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1] > 0:
        return chunked_argmax(logits)
    return logits.argmax(dim=-1)


def chunked_argmax(logits: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """The two kernels on logits [B, V] (unit stride along V, V >= 1; CPU tensors under TRITON_INTERPRET=1)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, block)
    maxima = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](logits, maxima, indices, vocab, logits.stride(0), num_chunks,
                                             BLOCK=block, num_warps=1 if _INTERPRET else 8)
    row_argmax_of_chunks_kernel[(rows,)](maxima, indices, out, num_chunks,
                                         BLOCK_C=max(2, triton.next_power_of_2(num_chunks)), num_warps=1)
    return out
