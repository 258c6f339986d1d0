"""Greedy sampling's chunked argmax (layers/argmax_kernels.py) equals torch.argmax: first index of the maximum across
chunk borders, NaN as the maximum, all -inf rows, bf16 logits, rows with a stride; under TRITON_INTERPRET=1 on CPU
(small chunks), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from braid.runtime.layers.argmax_kernels import argmax_last_dim, chunked_argmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 4096 if torch.cuda.is_available() else 64


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 63), (2, 64), (3, 65), (1, 1000), (4, 4 * BLOCK + 5)])
def test_chunked_argmax_equals_torch(rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(DEVICE)
    assert torch.equal(chunked_argmax(logits, BLOCK), logits.argmax(dim=-1))


def test_ties_nan_and_minus_inf_rows_like_torch():
    vocab = 3 * BLOCK + 7
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [BLOCK + 3, 2 * BLOCK + 1, 5]] = 9.0  # a tie across chunks: the first index
    logits[1, [2 * BLOCK + 1, BLOCK + 3]] = 9.0  # a tie inside later chunks
    logits[2, 2 * BLOCK + 4] = float("nan")  # NaN beats everything
    logits[3] = float("-inf")  # nothing allowed: index 0
    logits[4, vocab - 1] = 50.0  # the max in the last, partial chunk
    logits = logits.to(DEVICE)
    assert chunked_argmax(logits, BLOCK).tolist() == logits.argmax(dim=-1).tolist() == [5, BLOCK + 3, 2 * BLOCK + 4,
                                                                                          0, vocab - 1]


def test_bf16_and_strided_rows():
    wide = torch.randn(3, 2 * BLOCK + 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    view = wide[:, :2 * BLOCK + 9]  # rows BLOCK * 2 + 40 apart
    assert torch.equal(chunked_argmax(view, BLOCK), view.argmax(dim=-1))
    half = wide.to(torch.bfloat16)
    assert torch.equal(chunked_argmax(half, BLOCK), half.argmax(dim=-1))


def test_argmax_last_dim_keeps_torch_for_cpu_tensors(monkeypatch):
    """CPU tensors (the CPU runtime) take torch.argmax, never the interpreter."""
    from braid.runtime.layers import argmax_kernels

    monkeypatch.setattr(argmax_kernels, "chunked_argmax", lambda *a, **k: pytest.fail("kernel on a CPU tensor"))
    logits = torch.randn(2, 300)
    assert torch.equal(argmax_last_dim(logits), logits.argmax(dim=-1))
