"""The torch backend's batch-1 decode reads a sequence in consecutive KV slots through views of the pool; the
result must equal the gather path's for the same keys and values stored at scattered slots."""

from __future__ import annotations

import pytest
import torch

from braid.runtime.core import ForwardBatch, ForwardMode
from braid.runtime.layers.attention.torch_backend import TorchAttnBackend, _DecodeMetadata
from braid.runtime.layers.radix_attention import RadixAttention
from braid.runtime.mem_cache.pools import MHAKVPool, ReqToTokenPool

H, HKV, D, L = 9, 3, 64, 37


def decode_once(slots: torch.Tensor, k, v, q, layer: RadixAttention):
    """slots [L]: where the sequence's L keys live (the last is the new token's) -> (output [1, H*D], metadata)."""
    pool = MHAKVPool(256, torch.float32, HKV, D, 1, "cpu")
    r2t = ReqToTokenPool(4, 64, "cpu")
    r2t.req_to_token[2, :L] = slots.int()
    pool.set_kv(0, slots[:-1], k[:-1], v[:-1])
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1, input_ids=torch.zeros(1, dtype=torch.int64),
                      positions=torch.tensor([L - 1]), req_pool_indices=torch.tensor([2]),
                      seq_lens=torch.tensor([L], dtype=torch.int32), out_cache_loc=slots[-1:], seq_lens_cpu=[L],
                      req_to_token_pool=r2t, kv_pool=pool)
    backend = TorchAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    with torch.inference_mode():
        out = backend.forward(q, k[-1:].reshape(1, -1), v[-1:].reshape(1, -1), layer, fb)
    return out, fb.attn_metadata


@pytest.mark.parametrize("window,cap", [(-1, 0.0), (16, 0.0), (-1, 5.0)])
def test_consecutive_slots_read_as_views_equal_the_gather(window, cap):
    gen = torch.Generator().manual_seed(window + 7)
    k, v = torch.randn(L, HKV, D, generator=gen), torch.randn(L, HKV, D, generator=gen)
    q = torch.randn(1, H * D, generator=gen) * 3
    layer = RadixAttention(0, H, D, HKV, scaling=D ** -0.5, sliding_window=window, logit_cap=cap)
    consecutive = torch.arange(40, 40 + L)
    scattered = torch.randperm(255, generator=gen)[:L] + 1
    out_views, meta_views = decode_once(consecutive, k, v, q, layer)
    out_gather, meta_gather = decode_once(scattered, k, v, q, layer)
    assert isinstance(meta_views, _DecodeMetadata) and meta_views.first_slot == 40
    assert meta_gather.first_slot is None
    torch.testing.assert_close(out_views, out_gather, rtol=1e-5, atol=1e-5)
    # against attention written out by hand over the keys the layer may see
    lo = max(0, L - window) if window > 0 else 0
    qh = q.view(HKV, H // HKV, D)
    scores = torch.einsum("hgd,lhd->hgl", qh, k[lo:]) * layer.scaling
    if cap > 0:
        scores = cap * torch.tanh(scores / cap)
    want = torch.einsum("hgl,lhd->hgd", scores.softmax(-1), v[lo:]).reshape(1, H * D)
    torch.testing.assert_close(out_views, want, rtol=1e-4, atol=1e-4)
