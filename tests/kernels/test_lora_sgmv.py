"""The LoRA SGMV kernels (runtime/lora/sgmv_kernels.py) and the per-row BGMV ones (bgmv_kernels.py) against the
torch reference ops (runtime/lora/ops.py): rows on different adapters mixed with base rows (-1), an adapter of rank 4
padded in a rank-16 stack, 1 to 3 output slices of different widths (column blocks straddling slice borders),
in_features not a power of two, split-K partials, row blocks visited in sorted order; base rows of y stay bit for
bit. Under TRITON_INTERPRET=1 on CPU with small blocks, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from braid.runtime.lora import ops
from braid.runtime.lora.ops import lora_expand, lora_shrink
from braid.runtime.lora.bgmv_kernels import bgmv_expand, bgmv_shrink
from braid.runtime.lora.sgmv_kernels import row_order, sgmv_expand, sgmv_shrink

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN, RANK = 48, 16
ADAPTER_RANKS = [4, 16, 8]  # slot 0: rank 4, zero-padded to the stack's 16
SCALE = [0.5, 2.0, 1.25, 0.75]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _weights(outs, dtype, rank=RANK, ranks=ADAPTER_RANKS, seed=0):
    """(a [N, S * rank, IN], bs: S x [N, out_s, rank], scale [N]) with adapter n of rank ranks[n] (zero padding)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(ranks)
    a = torch.zeros(n, len(outs) * rank, IN)
    bs = [torch.zeros(n, o, rank) for o in outs]
    for slot, r in enumerate(ranks):
        for s, o in enumerate(outs):
            a[slot, s * rank:s * rank + r] = torch.randn(r, IN, generator=gen) * 0.2
            bs[s][slot, :, :r] = torch.randn(o, r, generator=gen) * 0.2
    return a.to(dtype), [b.to(dtype) for b in bs], torch.tensor(SCALE[:n]).to(dtype)


def _batch(t, outs, dtype, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, IN, generator=gen).to(dtype)
    y0 = torch.randn(t, sum(outs), generator=gen).to(dtype)
    idx = torch.randint(-1, n, (t,), generator=gen)
    if t > 1:
        idx[0], idx[1] = -1, n - 1  # a base row and an adapter row in every batch
    return x, y0, idx


def _check(x, y0, idx, a, bs, scale, sort=True, **blocks):
    dtype = x.dtype
    want_h = lora_shrink(x, a, idx)
    want_y = lora_expand(y0.clone(), want_h, bs, scale, idx)
    dev = [v.to(DEVICE) for v in (x, y0, idx, a, scale)]
    x_d, y_d, idx_d, a_d, scale_d = dev
    bs_d = [b.to(DEVICE) for b in bs]
    order = row_order(idx_d, blocks.get("block_t")) if sort else None
    h = sgmv_shrink(x_d, a_d, idx_d, order, block_t=blocks.get("block_t"), block_k=blocks.get("block_k"),
                    split_k=blocks.get("split_k"))
    assert h.dtype == torch.float32 and h.shape[1:] == want_h.shape
    torch.testing.assert_close(h.sum(0).cpu().to(dtype), want_h, **TOL[dtype])
    assert torch.all(h[:, idx_d < 0] == 0)
    y = sgmv_expand(y_d, h, bs_d, scale_d, idx_d, order, block_t=blocks.get("block_t"),
                    block_n=blocks.get("block_n"))
    assert y is y_d
    torch.testing.assert_close(y.cpu(), want_y, **TOL[dtype])
    assert torch.equal(y.cpu()[idx < 0], y0[idx < 0])
    return h


SMALL = dict(block_t=16, block_k=16, block_n=16)  # several row, K and column blocks at these sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outs", [[48], [32, 24], [40, 8, 8]], ids=["S1", "S2", "S3"])
@pytest.mark.parametrize("t", [1, 7, 64])
def test_kernels_match_the_torch_ops(t, outs, dtype):
    a, bs, scale = _weights(outs, dtype)
    x, y0, idx = _batch(t, outs, dtype, len(scale))
    h = _check(x, y0, idx, a, bs, scale, split_k=2, **SMALL)
    assert h.shape[0] == 2  # IN = 48 over 3 chunks of 16: splits of 2 chunks and 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outs", [[48], [32, 24], [40, 8, 8]], ids=["S1", "S2", "S3"])
@pytest.mark.parametrize("t", [1, 7, 20])
def test_per_row_kernels_match_the_torch_ops(t, outs, dtype):
    """bgmv: each row on its own adapter (rank 4 padded to 16 among them), base rows bit for bit, K split in
    partials; its partials feed sgmv_expand too, and sgmv_shrink's feed bgmv_expand (the two share h's layout)."""
    a, bs, scale = _weights(outs, dtype)
    x, y0, idx = _batch(t, outs, dtype, len(scale))
    want_h = lora_shrink(x, a, idx)
    want_y = lora_expand(y0.clone(), want_h, bs, scale, idx)
    x_d, y_d, idx_d, a_d, scale_d = (v.to(DEVICE) for v in (x, y0, idx, a, scale))
    bs_d = [b.to(DEVICE) for b in bs]
    h = bgmv_shrink(x_d, a_d, idx_d, split_k=2, block_k=16)
    assert h.dtype == torch.float32 and h.shape == (2, t, want_h.shape[1])
    torch.testing.assert_close(h.sum(0).cpu().to(dtype), want_h, **TOL[dtype])
    assert torch.all(h[:, idx_d < 0] == 0)
    y = bgmv_expand(y_d.clone(), h, bs_d, scale_d, idx_d, block_n=16)
    torch.testing.assert_close(y.cpu(), want_y, **TOL[dtype])
    assert torch.equal(y.cpu()[idx < 0], y0[idx < 0])
    crossed = sgmv_expand(y_d.clone(), h, bs_d, scale_d, idx_d, block_n=16)
    torch.testing.assert_close(crossed.cpu(), want_y, **TOL[dtype])
    crossed = bgmv_expand(y_d.clone(), sgmv_shrink(x_d, a_d, idx_d, block_k=16), bs_d, scale_d, idx_d)
    torch.testing.assert_close(crossed.cpu(), want_y, **TOL[dtype])


def test_row_blocks_of_mixed_adapters_in_batch_order():
    """Without the sorted order every row block holds rows of several adapters and base rows."""
    outs = [32, 24]
    a, bs, scale = _weights(outs, torch.float32)
    x, y0, idx = _batch(40, outs, torch.float32, 3, seed=4)
    _check(x, y0, idx, a, bs, scale, sort=False, split_k=3, **SMALL)


def test_launch_defaults_and_rank_64():
    """The block sizes and split count the launchers pick themselves; a rank-64 stack (one rank block of 64)."""
    outs = [40, 24]
    a, bs, scale = _weights(outs, torch.float32, rank=64, ranks=[64, 16, 4, 33])
    x, y0, idx = _batch(20, outs, torch.float32, 4)
    _check(x, y0, idx, a, bs, scale)


def test_h_from_the_torch_op_and_strided_x():
    """sgmv_expand takes a plain h [T, S * R] too; x may be a column slice of a wider tensor."""
    outs = [16, 32]
    a, bs, scale = _weights(outs, torch.float32)
    wide = torch.randn(9, IN + 16, generator=torch.Generator().manual_seed(3))
    x = wide[:, 8:8 + IN]
    _, y0, idx = _batch(9, outs, torch.float32, 3)
    h = sgmv_shrink(x.to(DEVICE), a.to(DEVICE), idx.to(DEVICE), block_k=16, split_k=1)
    torch.testing.assert_close(h[0].cpu(), lora_shrink(x, a, idx), **TOL[torch.float32])
    want = lora_expand(y0.clone(), lora_shrink(x, a, idx), bs, scale, idx)
    got = sgmv_expand(y0.to(DEVICE), lora_shrink(x, a, idx).to(DEVICE), [b.to(DEVICE) for b in bs],
                      scale.to(DEVICE), idx.to(DEVICE), block_n=16)
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])


def test_all_base_rows_and_empty_batch():
    outs = [16]
    a, bs, scale = _weights(outs, torch.float32)
    x, y0, _ = _batch(5, outs, torch.float32, 3)
    idx = torch.full((5,), -1).to(DEVICE)
    h = sgmv_shrink(x.to(DEVICE), a.to(DEVICE), idx, block_k=16)
    assert torch.all(h == 0)
    y = sgmv_expand(y0.to(DEVICE), h, [b.to(DEVICE) for b in bs], scale.to(DEVICE), idx, block_n=16)
    assert torch.equal(y.cpu(), y0)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    h = sgmv_shrink(x[:0].to(DEVICE), a.to(DEVICE), empty)
    assert sgmv_expand(y0[:0].to(DEVICE), h, [b.to(DEVICE) for b in bs], scale.to(DEVICE), empty).shape == (0, 16)
    h = bgmv_shrink(x[:0].to(DEVICE), a.to(DEVICE), empty)
    assert bgmv_expand(y0[:0].to(DEVICE), h, [b.to(DEVICE) for b in bs], scale.to(DEVICE), empty).shape == (0, 16)
    h = bgmv_shrink(x.to(DEVICE), a.to(DEVICE), idx)
    assert torch.all(h == 0)
    assert torch.equal(bgmv_expand(y0.to(DEVICE), h, [b.to(DEVICE) for b in bs], scale.to(DEVICE), idx).cpu(), y0)


def test_row_order_is_sorted_stable_and_kept_per_idx_tensor():
    idx = torch.tensor([2, -1, 0, 2, 0, -1, 1, 2] * 3)
    order = row_order(idx, 4)
    assert idx[order].tolist() == sorted(idx.tolist())
    assert all(a < b for a, b in zip(order.tolist(), order.tolist()[1:]) if idx[a] == idx[b])
    assert row_order(idx, 4) is order  # the same tensor, unchanged: one sort per forward pass
    idx[0] = 1  # changed in place (a CUDA graph's static buffer refilled): sorted again
    assert idx[row_order(idx, 4)].tolist() == sorted(idx.tolist())
    assert row_order(idx, 64) is None  # one row block: no order needed


def test_ops_take_the_torch_path_on_cpu(monkeypatch):
    """CPU tensors (the CPU runtime) keep the torch reference, never the interpreter."""
    for name in ("sgmv_shrink", "sgmv_expand", "bgmv_shrink", "bgmv_expand"):
        monkeypatch.setattr(ops, name, lambda *a, **k: pytest.fail("kernel on a CPU tensor"))
    a, bs, scale = _weights([16], torch.float32)
    x, y0, idx = _batch(4, [16], torch.float32, 3)
    lora_expand(y0, lora_shrink(x, a, idx), bs, scale, idx)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [200, ops.BGMV_MAX_ROWS, 3])
def test_ops_on_the_device_at_llama_shapes(t):
    """lora_shrink / lora_expand on CUDA tensors (the kernels, default blocks) equal the torch path on the CPU:
    a qkv-shaped linear, decode rows over 8 adapters and base rows, bf16; SGMV above BGMV_MAX_ROWS, BGMV up to it."""
    gen = torch.Generator().manual_seed(0)
    d_in, rank, outs, n = 4096, 16, [4096, 1024, 1024], 8
    x = torch.randn(t, d_in, generator=gen).bfloat16()
    a = (torch.randn(n, 3 * rank, d_in, generator=gen) * 0.02).bfloat16()
    bs = [(torch.randn(n, o, rank, generator=gen) * 0.05).bfloat16() for o in outs]
    scale = torch.rand(n, generator=gen).bfloat16() + 0.5
    idx = torch.randint(-1, n, (t,), generator=gen)
    y0 = torch.randn(t, sum(outs), generator=gen).bfloat16()
    want = lora_expand(y0.clone(), lora_shrink(x, a, idx), bs, scale, idx)
    cuda = [v.cuda() for v in (x, a, scale, idx, y0)]
    x_d, a_d, scale_d, idx_d, y_d = cuda
    got = lora_expand(y_d, lora_shrink(x_d, a_d, idx_d), [b.cuda() for b in bs], scale_d, idx_d)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(got.cpu()[idx < 0], y0[idx < 0])
