"""Flattened KV slot lists (CSR) for paged-attention libraries that take a page list per request (FlashInfer): every
key of each request, or only the keys a sliding-window layer can see, so that such a layer's kernels never read
(nor need) the KV of tokens older than its window."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["build_kv_indices", "window_kv_spans", "csr_indptr"]

_BLOCK = 512


@triton.jit
def _kv_indices_kernel(req_to_token, req_pool_indices, kv_indptr, kv_starts, kv_indices, stride_row,
                       HAS_START: tl.constexpr, BLOCK: tl.constexpr):
    # one program per request: kv_indices[kv_indptr[b]:kv_indptr[b+1]] = req_to_token[row b, start : start + len]
    b = tl.program_id(0)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    out = tl.load(kv_indptr + b)
    n = tl.load(kv_indptr + b + 1) - out
    first = 0
    if HAS_START:
        first = tl.load(kv_starts + b).to(tl.int64)
    for off in range(0, n, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(req_to_token + row * stride_row + first + offs, mask=mask)
        tl.store(kv_indices + out + offs, slots, mask=mask)


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, batch_size: int, kv_starts: Optional[torch.Tensor] = None) -> None:
    """req_to_token: [R, C] int32; req_pool_indices: [>= B]; kv_indptr: [>= B + 1] int32 on the same device;
    kv_starts: [>= B] int32, each request's first position (default 0). Writes kv_indices[:kv_indptr[B]] (int32)
    in one launch, without a host synchronization."""
    if batch_size == 0:
        return
    _kv_indices_kernel[(batch_size,)](req_to_token, req_pool_indices, kv_indptr,
                                      kv_starts if kv_starts is not None else kv_indptr, kv_indices,
                                      req_to_token.stride(0), HAS_START=kv_starts is not None, BLOCK=_BLOCK)


def window_kv_spans(seq_lens: list[int], qo_lens: list[int], window: int) -> tuple[list[int], list[int]]:
    """(first key position, key count) per request for a window-W layer whose last qo_lens[b] of seq_lens[b]
    positions are queries: the first query, at p = seq - qo, sees keys from p - W + 1 (keys (p - W, p])."""
    starts = [max(0, seq - qo - window + 1) for seq, qo in zip(seq_lens, qo_lens)]
    return starts, [seq - start for seq, start in zip(seq_lens, starts)]


def csr_indptr(lengths: list[int]) -> torch.Tensor:
    """Host CSR offsets [len(lengths) + 1] int32."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out
