"""The grammar-mask kernel (layers/token_bitmask.py) equals the torch unpacking: every bit of a word (the sign bit
too), vocabularies that end inside a word, bitmasks wider than the vocabulary, rows with a stride, bf16 logits; under
TRITON_INTERPRET=1 on CPU (small blocks), compiled on a GPU at Llama-3's vocabulary. The host path (CPU tensors)
equals it too."""

from __future__ import annotations

import pytest
import torch

from braid.runtime.constrained.bitmask import allocate_bitmask, clear_tokens, ids_to_bitmask_row, unpack_row
from braid.runtime.layers.token_bitmask import apply_token_bitmask_, unpack_token_bitmask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 4096 if torch.cuda.is_available() else 64


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (2, 31), (3, 32), (2, 33), (4, 1000), (3, 3 * BLOCK + 17)])
def test_kernel_equals_unpacked_mask(rows, vocab):
    bitmask = _random_bitmask(rows, vocab, vocab)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    expected = logits.masked_fill(~unpack_token_bitmask(bitmask, vocab), float("-inf"))
    got = logits.to(DEVICE)
    apply_token_bitmask_(got, bitmask.to(DEVICE), use_kernel=True, block=BLOCK)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (2, 31), (3, 32), (2, 33), (5, 1000), (2, 49152)])
def test_host_path_equals_unpacked_mask(rows, vocab):
    """The CPU path (numpy's byte unpacking) on a bitmask wider than the vocabulary and a column slice of one."""
    wide = _random_bitmask(rows, vocab + 70, vocab + 1)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    for bitmask in (wide, wide[:, 1:]):
        expected = logits.masked_fill(~unpack_token_bitmask(bitmask, vocab), float("-inf"))
        got = logits.clone()
        apply_token_bitmask_(got, bitmask, use_kernel=False)
        assert torch.equal(got, expected)


def test_sign_bit_strided_rows_wide_bitmask_and_bf16():
    vocab = 2 * BLOCK + 5
    allowed = [0, 31, 63, BLOCK + 31, vocab - 1]  # bit 31 of a word is its sign bit
    bitmask = torch.stack([ids_to_bitmask_row(allowed, vocab + 64), ids_to_bitmask_row([31], vocab + 64)])
    wide = torch.randn(2, vocab + 40, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.bfloat16):
        logits = wide.to(dtype).to(DEVICE)[:, :vocab]  # rows vocab + 40 apart
        apply_token_bitmask_(logits, bitmask.to(DEVICE), use_kernel=True, block=BLOCK)
        finite = torch.isfinite(logits.float().cpu())
        assert finite[0].nonzero().squeeze(1).tolist() == allowed
        assert finite[1].nonzero().squeeze(1).tolist() == [31]


def test_host_helpers_round_trip():
    vocab = 100
    row = ids_to_bitmask_row([0, 5, 31, 32, 99], vocab)
    assert unpack_row(row, vocab).tolist() == [0, 5, 31, 32, 99]
    clear_tokens(row, [31, 5])
    assert unpack_row(row, vocab).tolist() == [0, 32, 99]
    full = allocate_bitmask(2, vocab)
    assert len(unpack_row(full[1], vocab)) == vocab
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))  # 96 bits < 100 tokens


@pytest.mark.gpu
def test_llama3_vocabulary_batch_512_on_gpu():
    vocab, rows = 128256, 512
    bitmask = _random_bitmask(rows, vocab, 3).cuda()
    logits = torch.randn(rows, vocab, device="cuda")
    expected = logits.masked_fill(~unpack_token_bitmask(bitmask, vocab), float("-inf"))
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)
