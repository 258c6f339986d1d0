"""Attention over a hybrid KV pool (mem_cache/window_pool.py): the Triton backend (compiled on a GPU, else under
TRITON_INTERPRET=1) and the torch backend read window layers through the full -> window slot map, after the
window KV of old tokens was released and its slots handed to other tokens, and equal attention over the raw K/V."""

from types import SimpleNamespace

import pytest
import torch

from braid.runtime.core import ForwardBatch, ForwardMode
from braid.runtime.layers.attention.torch_backend import TorchAttnBackend
from braid.runtime.layers.attention.triton_backend import TritonAttnBackend
from braid.runtime.mem_cache.pools import ReqToTokenPool
from braid.runtime.mem_cache.window_pool import HybridKVPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, WINDOW = 4, 2, 16, 8
GARBAGE = 1e3


def _layer(layer_id: int, window: int):
    return SimpleNamespace(layer_id=layer_id, num_heads=H, num_kv_heads=HKV, head_dim=D, v_head_dim=D,
                           scaling=D ** -0.5, logit_cap=0.0, sliding_window=window)


LAYERS = {"window": _layer(0, WINDOW), "global": _layer(1, -1)}


class Setup:
    def __init__(self):
        gen = torch.Generator().manual_seed(3)
        self.pool = HybridKVPool(120, 64, torch.float32, HKV, D, [WINDOW, None], DEVICE)
        self.req_pool = ReqToTokenPool(4, 48, DEVICE)
        self.k = {0: torch.randn(40, HKV, D, generator=gen), 1: torch.randn(40, HKV, D, generator=gen)}
        self.v = {0: torch.randn(40, HKV, D, generator=gen), 1: torch.randn(40, HKV, D, generator=gen)}
        self.q = {0: torch.randn(40, H, D, generator=gen), 1: torch.randn(40, H, D, generator=gen)}
        self.lens = {0: 0, 1: 0}
        self.gen = gen
        runner = SimpleNamespace(device=DEVICE, model_config=SimpleNamespace(
            num_attention_heads=H, num_key_value_heads=HKV, head_dim=D, v_head_dim=D), tp_size=1)
        self.triton = TritonAttnBackend(runner, num_kv_splits=2)
        self.torch = TorchAttnBackend(runner)

    def write(self, req: int, n: int) -> torch.Tensor:
        start = self.lens[req]
        loc = self.pool.alloc(n)
        self.req_pool.req_to_token[req, start:start + n] = loc.int()
        for layer in (0, 1):
            self.pool.set_kv(layer, loc, self.k[req][start:start + n].to(DEVICE), self.v[req][start:start + n].to(DEVICE))
        self.lens[req] += n
        return loc

    def release_old(self) -> None:
        """Release the window KV no next query sees, give those slots to other tokens and fill them (and the dummy
        slot) with garbage: a kernel that read a released position would show it."""
        for req, length in self.lens.items():
            self.pool.release_window(self.req_pool.req_to_token[req, :length - (WINDOW - 1)].long())
        others = self.pool.alloc(self.pool.window_available_size() - 12)  # 12 left for the passes below
        junk = torch.full((others.numel(), HKV, D), GARBAGE, device=DEVICE)
        for layer in (0, 1):
            self.pool.set_kv(layer, others, junk, junk)
        for layer in (0, 1):
            self.pool.get_key_buffer(layer)[0] = GARBAGE
            self.pool.get_value_buffer(layer)[0] = GARBAGE

    def reference(self, req: int, pos: int, window: int) -> torch.Tensor:
        lo = max(0, pos - window + 1) if window > 0 else 0
        k = self.k[req][lo:pos + 1].repeat_interleave(H // HKV, dim=1)  # [n, H, D]
        v = self.v[req][lo:pos + 1].repeat_interleave(H // HKV, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", self.q[req][pos], k) * D ** -0.5, dim=-1)
        return torch.einsum("hn,nhd->hd", probs, v).reshape(H * D)

    def batch(self, mode, reqs, news, locs) -> ForwardBatch:
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
        prefix = [self.lens[r] - n for r, n in zip(reqs, news)]
        seq = [self.lens[r] for r in reqs]
        ext = i32(news)
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(reqs), input_ids=torch.zeros(sum(news), dtype=torch.int64, device=DEVICE),
            positions=torch.cat([torch.arange(p, s, device=DEVICE) for p, s in zip(prefix, seq)]),
            req_pool_indices=torch.tensor(reqs, device=DEVICE), seq_lens=i32(seq), out_cache_loc=torch.cat(locs),
            seq_lens_cpu=seq)
        if mode == ForwardMode.EXTEND:
            fb.extend_prefix_lens, fb.extend_seq_lens = i32(prefix), ext
            fb.extend_start_loc = torch.cumsum(ext, 0, dtype=torch.int32) - ext
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = prefix, list(news)
        fb.req_to_token_pool, fb.kv_pool = self.req_pool, self.pool
        return fb

    def inputs(self, reqs, news):
        q = torch.cat([self.q[r][self.lens[r] - n:self.lens[r]] for r, n in zip(reqs, news)])
        k = torch.cat([self.k[r][self.lens[r] - n:self.lens[r]] for r, n in zip(reqs, news)])
        v = torch.cat([self.v[r][self.lens[r] - n:self.lens[r]] for r, n in zip(reqs, news)])
        return (q.reshape(q.shape[0], -1).to(DEVICE), k.reshape(k.shape[0], -1).to(DEVICE),
                v.reshape(v.shape[0], -1).to(DEVICE))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layer", ["window", "global"])
def test_decode_and_extend_read_window_layers_through_the_slot_map(backend, layer):
    s = Setup()
    s.write(0, 30)
    s.write(1, 21)
    s.release_old()
    attn = s.triton if backend == "triton" else s.torch
    spec = LAYERS[layer]
    locs = [s.write(0, 1), s.write(1, 1)]
    fb = s.batch(ForwardMode.DECODE, [0, 1], [1, 1], locs)
    attn.init_forward_metadata(fb)
    q, k, v = s.inputs([0, 1], [1, 1])
    out = attn.forward(q, k, v, spec, fb).cpu()
    want = torch.stack([s.reference(0, 30, spec.sliding_window), s.reference(1, 21, spec.sliding_window)])
    torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)

    locs = [s.write(0, 5), s.write(1, 3)]  # prefixes 31 and 22 whose old window KV is gone
    fb = s.batch(ForwardMode.EXTEND, [0, 1], [5, 3], locs)
    attn.init_forward_metadata(fb)
    q, k, v = s.inputs([0, 1], [5, 3])
    out = attn.forward(q, k, v, spec, fb).cpu()
    want = torch.stack([s.reference(0, p, spec.sliding_window) for p in range(31, 36)]
                       + [s.reference(1, p, spec.sliding_window) for p in range(22, 25)])
    torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)
