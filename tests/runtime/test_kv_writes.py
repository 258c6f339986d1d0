"""The KV pool is the only writer of KV: set_kv and rotate_and_set_kv write exactly the slots asked for (in the
cache dtype, fp8 e4m3 quantized with the layer's scales), RadixAttention stores decode KV through the pool, and
no module under runtime/ outside mem_cache/ writes pool buffers itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from braid.runtime.core import ForwardBatch, ForwardMode
from braid.runtime.layers.attention.torch_backend import TorchAttnBackend
from braid.runtime.layers.radix_attention import RadixAttention
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.mem_cache.pools import MHAKVPool, MLAKVPool, ReqToTokenPool

H, HKV, D, DV, LAYERS, SLOTS = 4, 2, 8, 6, 3, 32
RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

# (kv_cache_dtype, model dtype, per-layer k scales, per-layer v scales, relative tolerance of a round trip)
CACHES = {
    "fp32": ("auto", torch.float32, 1.0, 1.0, 0.0),
    "bf16": ("auto", torch.bfloat16, 1.0, 1.0, 0.0),
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 (values kept out of the subnormals)
    "fp8_e4m3": ("fp8_e4m3", torch.bfloat16, [1.0, 0.25, 3.0], [1.0, 2.0, 0.5], 2 ** -4),
}


def make_pool(cache: str) -> MHAKVPool:
    kv_cache_dtype, dtype, k_scale, v_scale, _ = CACHES[cache]
    return MHAKVPool(SLOTS, dtype, HKV, D, LAYERS, "cpu", v_head_dim=DV, kv_cache_dtype=kv_cache_dtype,
                     k_scale=k_scale, v_scale=v_scale)


def away_from_zero(shape, gen, dtype):
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * (0.25 + 3 * torch.rand(shape, generator=gen))).to(dtype)


def read_back(pool: MHAKVPool, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k_scale, v_scale = pool.kv_scales(layer)
    return (pool.get_key_buffer(layer)[loc].float() * k_scale, pool.get_value_buffer(layer)[loc].float() * v_scale)


def assert_only_slots_written(pool: MHAKVPool, layer: int, loc: torch.Tensor) -> None:
    written = torch.zeros(SLOTS + 1, dtype=torch.bool)
    written[loc] = True
    for other in range(LAYERS):
        k, v = pool.get_key_buffer(other).float(), pool.get_value_buffer(other).float()
        untouched = ~written if other == layer else torch.ones_like(written)
        assert not k[untouched].any() and not v[untouched].any(), other


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_set_kv_writes_exactly_the_slots_asked_for(cache):
    pool = make_pool(cache)
    *_, rel_tol = CACHES[cache]
    gen = torch.Generator().manual_seed(1)
    loc = torch.tensor([5, 17, 2, 30])
    k = away_from_zero((4, HKV * D), gen, pool.dtype)
    v = away_from_zero((4, HKV, DV), gen, pool.dtype)
    pool.set_kv(2, loc, k, v)
    k_back, v_back = read_back(pool, 2, loc)
    torch.testing.assert_close(k_back, k.float().view(4, HKV, D), rtol=rel_tol, atol=0)
    torch.testing.assert_close(v_back, v.float(), rtol=rel_tol, atol=0)
    assert_only_slots_written(pool, 2, loc)


def test_fp8_e4m3_per_layer_scales_are_applied_on_store():
    pool = make_pool("fp8_e4m3")
    loc = torch.tensor([3])
    k = torch.full((1, HKV, D), 1.5, dtype=torch.bfloat16)
    v = torch.full((1, HKV, DV), 1.5, dtype=torch.bfloat16)
    pool.set_kv(2, loc, k, v)
    # layer 2 stores k / 3.0 and v / 0.5: 0.5 and 3.0 are exact in e4m3
    assert (pool.get_key_buffer(2)[loc].float() == 0.5).all()
    assert (pool.get_value_buffer(2)[loc].float() == 3.0).all()


def test_set_kv_rejects_rows_that_do_not_fit_the_slots():
    pool = make_pool("fp32")
    with pytest.raises(ValueError, match="for 2 slots"):
        pool.set_kv(0, torch.tensor([1, 2]), torch.zeros(3, HKV * D), torch.zeros(3, HKV * DV))
    with pytest.raises(ValueError, match="1-D"):
        pool.set_kv(0, torch.tensor([[1, 2]]), torch.zeros(2, HKV * D), torch.zeros(2, HKV * DV))


def make_rope(rotary_dim=D, neox=True) -> RotaryEmbedding:
    rope = RotaryEmbedding(D, rotary_dim, 64, 10000.0, is_neox_style=neox)
    rope.build_cache("cpu")
    return rope


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_rotate_and_set_kv_stores_the_rotated_key(cache):
    pool = make_pool(cache)
    *_, rel_tol = CACHES[cache]
    rope = make_rope(rotary_dim=4)
    gen = torch.Generator().manual_seed(2)
    loc, positions = torch.tensor([9, 1, 22]), torch.tensor([0, 7, 63])
    q = away_from_zero((3, H * D), gen, pool.dtype)
    k = away_from_zero((3, HKV * D), gen, pool.dtype)
    v = away_from_zero((3, HKV * DV), gen, pool.dtype)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q = pool.rotate_and_set_kv(1, loc, positions, q, k, v, rope)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
    k_back, v_back = read_back(pool, 1, loc)
    torch.testing.assert_close(k_back, want_k.float().view(3, HKV, D), rtol=rel_tol, atol=0)
    torch.testing.assert_close(v_back, v.float().view(3, HKV, DV), rtol=rel_tol, atol=0)
    assert_only_slots_written(pool, 1, loc)


def test_mla_set_kv_writes_latent_and_rope_part():
    pool = MLAKVPool(8, torch.float32, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=2, device="cpu")
    loc = torch.tensor([4, 1])
    latent, rope = torch.randn(2, 1, 6), torch.randn(2, 2)
    pool.set_kv(1, loc, rope, latent)  # k: only the rope part
    torch.testing.assert_close(pool.get_key_buffer(1)[loc], torch.cat([latent, rope.view(2, 1, 2)], dim=-1))
    key = torch.randn(2, 8)
    pool.set_kv(0, loc, key, key[:, :6])  # k: the whole key row, v: its latent view
    torch.testing.assert_close(pool.get_key_buffer(0)[loc].view(2, 8), key)
    assert not pool.get_key_buffer(0)[torch.tensor([0, 2, 3, 5, 6, 7, 8])].any()
    with pytest.raises(ValueError, match="rope part"):
        pool.set_kv(0, loc, torch.randn(2, 5), latent)


def test_mla_fp8_e4m3_scale_on_store():
    pool = MLAKVPool(8, torch.bfloat16, kv_lora_rank=4, qk_rope_head_dim=4, layer_num=1, device="cpu",
                     kv_cache_dtype="fp8_e4m3", kv_scale=2.0)
    loc = torch.tensor([3])
    pool.set_kv(0, loc, torch.full((1, 4), 6.0, dtype=torch.bfloat16), torch.full((1, 4), 1.0, dtype=torch.bfloat16))
    assert pool.get_key_buffer(0)[loc].float().flatten().tolist() == [0.5] * 4 + [3.0] * 4


def decode_batch(pool: MHAKVPool, slots: torch.Tensor, backend) -> ForwardBatch:
    """One request whose len(slots) tokens live at `slots`; the last one is being decoded."""
    n = slots.shape[0]
    r2t = ReqToTokenPool(2, 16, "cpu")
    r2t.req_to_token[1, :n] = slots.int()
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1, input_ids=torch.zeros(1, dtype=torch.int64),
                      positions=torch.tensor([n - 1]), req_pool_indices=torch.tensor([1]),
                      seq_lens=torch.tensor([n], dtype=torch.int32), out_cache_loc=slots[-1:], seq_lens_cpu=[n],
                      req_to_token_pool=r2t, kv_pool=pool)
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    return fb


def test_radix_attention_decode_stores_through_rotate_and_set_kv(monkeypatch):
    pool = make_pool("fp32")
    rope = make_rope()
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([4, 11, 7])
    keys, values = torch.randn(3, HKV * D, generator=gen), torch.randn(3, HKV * DV, generator=gen)
    _, rotated_keys = rope.forward_native(torch.arange(3), torch.zeros(3, H * D), keys)
    pool.set_kv(0, slots[:2], rotated_keys[:2], values[:2])
    calls = []
    real = MHAKVPool.rotate_and_set_kv
    monkeypatch.setattr(MHAKVPool, "rotate_and_set_kv", lambda self, *a: calls.append(a[0]) or real(self, *a))
    layer = RadixAttention(0, H, D, HKV, scaling=D ** -0.5, v_head_dim=DV)
    q = torch.randn(1, H * D, generator=gen)
    fb = decode_batch(pool, slots, TorchAttnBackend())
    out = layer(q, keys[2:], values[2:], fb, rotary=rope, positions=fb.positions)
    assert calls == [0]
    torch.testing.assert_close(pool.get_key_buffer(0)[slots[2]], rotated_keys[2].view(HKV, D))
    # the same as rotating first and letting the backend store the rotated key
    reference_pool = make_pool("fp32")
    reference_pool.set_kv(0, slots[:2], rotated_keys[:2], values[:2])
    q_rot, k_rot = rope.forward_native(fb.positions, q, keys[2:])
    want = TorchAttnBackend().forward(q_rot, k_rot, values[2:], layer, decode_batch(reference_pool, slots,
                                                                                    TorchAttnBackend()))
    torch.testing.assert_close(out, want)


# pool buffer writes and the raw store kernels: allowed in mem_cache/ and in the kernel modules that define them
_WRITE_PATTERNS = [r"set_kv_buffer\(", r"direct_write_buffers", r"\bk_buffers?\[", r"\bv_buffers?\[", r"\bkv_buffers?\[",
                   r"_k_buffers", r"_v_buffers", r"_kv_buffers", r"\bstore_kv\(", r"apply_rotary_and_store_kv\("]
_DEFINING_MODULES = {"layers/kv_store_kernels.py": [r"\bstore_kv\("],
                     "layers/rotary_kernels.py": [r"apply_rotary_and_store_kv\("]}


def test_no_module_outside_mem_cache_writes_pool_buffers():
    offenders = []
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME).as_posix()
        if rel.startswith("mem_cache/"):
            continue
        allowed = _DEFINING_MODULES.get(rel, [])
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in _WRITE_PATTERNS:
                if pattern not in allowed and re.search(pattern, line):
                    offenders.append(f"runtime/{rel}:{lineno}: {line.strip()}")
    assert not offenders, "KV written outside the pool:\n" + "\n".join(offenders)
