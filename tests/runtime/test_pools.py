import pytest
import torch

from braid.runtime.dtypes import kv_cache_dtype
from braid.runtime.mem_cache.kv_sizing import (
    kv_cache_bytes_per_token,
    max_tokens_for_budget,
    mha_kv_bytes_per_token,
    mla_kv_bytes_per_token,
)
from braid.runtime.mem_cache.pools import MHAKVPool, MLAKVPool, ReqToTokenPool


def _mha(size=16, dtype=torch.float32, **kw):
    return MHAKVPool(size, dtype, head_num=2, head_dim=4, layer_num=3, device="cpu", **kw)


# ---- ReqToTokenPool ----
def test_req_to_token_pool_alloc_free_exhaust_clear():
    pool = ReqToTokenPool(4, 8, "cpu")
    assert pool.req_to_token.shape == (4, 8) and pool.req_to_token.dtype == torch.int32
    rows = [pool.alloc() for _ in range(4)]
    assert sorted(rows) == [0, 1, 2, 3]
    assert pool.available_size() == 0
    assert pool.alloc() is None
    pool.free(rows[1])
    assert pool.available_size() == 1
    assert pool.alloc() == rows[1]
    with pytest.raises(ValueError):
        pool.free(9)
    pool.free(rows[0])
    with pytest.raises(ValueError, match="already free"):
        pool.free(rows[0])
    pool.clear()
    assert pool.available_size() == pool.size
    assert sorted(pool.alloc() for _ in range(4)) == [0, 1, 2, 3]


def test_req_to_token_pool_rejects_bad_sizes():
    with pytest.raises(ValueError):
        ReqToTokenPool(0, 8, "cpu")
    with pytest.raises(ValueError):
        ReqToTokenPool(2, -1, "cpu")


# ---- slot allocation ----
def test_kv_alloc_free_exhaustion_clear():
    pool = _mha(size=10)
    assert pool.available_size() == 10
    a = pool.alloc(4)
    b = pool.alloc(6)
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    got = torch.cat([a, b]).tolist()
    assert sorted(got) == list(range(1, 11)), "slot 0 is reserved, 1..size are handed out once each"
    assert pool.available_size() == 0
    assert pool.alloc(1) is None
    assert pool.alloc(0).numel() == 0
    pool.free(a)
    assert pool.available_size() == 4
    assert pool.alloc(5) is None
    assert sorted(pool.alloc(4).tolist()) == sorted(a.tolist())
    pool.free(torch.empty(0, dtype=torch.int64))
    pool.free(b[:2].to(torch.int32))
    assert pool.available_size() == 2
    with pytest.raises(ValueError):
        pool.alloc(-1)
    pool.clear()
    assert pool.available_size() == pool.size
    assert sorted(pool.alloc(10).tolist()) == list(range(1, 11))


def test_kv_alloc_after_many_small_cycles_keeps_every_slot_once():
    pool = _mha(size=32)
    gen = torch.Generator().manual_seed(0)
    held: list[torch.Tensor] = []
    for _ in range(200):
        if held and torch.rand((), generator=gen) < 0.5:
            pool.free(held.pop(int(torch.randint(len(held), (), generator=gen))))
        else:
            got = pool.alloc(int(torch.randint(1, 5, (), generator=gen)))
            if got is not None:
                held.append(got)
        owned = torch.cat([pool.free_slots, *held]).tolist()
        assert sorted(owned) == list(range(1, 33))
    for h in held:
        pool.free(h)
    assert pool.available_size() == pool.size


def test_kv_free_list_wraps_around_and_catches_overflow():
    pool = _mha(size=5)
    first = pool.alloc(4)  # 1..4 out, 5 left
    pool.free(first[:3])  # the ring now wraps: 5, 1, 2, 3
    got = pool.alloc(4)
    assert got.tolist() == [5, 1, 2, 3]
    got[0] = -1  # alloc hands out copies: the ring is not changed through them
    pool.free(first[3:])
    assert pool.free_slots.tolist() == [4]
    pool.free(torch.tensor([5, 1, 2, 3]))
    assert sorted(pool.free_slots.tolist()) == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(torch.tensor([2]))
    assert pool.available_size() == pool.size


def test_pools_built_under_inference_mode_work_outside_it():
    with torch.inference_mode():
        kv = _mha(size=8)
        rows = ReqToTokenPool(2, 4, "cpu")
    loc = kv.alloc(3)
    kv.free(loc)
    kv.set_kv(0, loc, torch.ones(3, 2, 4), torch.ones(3, 2, 4))
    rows.req_to_token[0, :3] = loc.to(torch.int32)
    with torch.inference_mode():
        loc = kv.alloc(2)
        kv.set_kv(1, loc, torch.ones(2, 2, 4), torch.ones(2, 2, 4))
    kv.free(loc)
    kv.clear()
    kv.free(kv.alloc(8))
    assert kv.available_size() == kv.size


# ---- MHA ----
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mha_set_get_per_layer(dtype):
    pool = MHAKVPool(8, dtype, head_num=2, head_dim=4, layer_num=3, device="cpu", v_head_dim=6)
    assert pool.store_dtype == dtype and pool.dtype == dtype
    for layer in range(3):
        assert pool.get_key_buffer(layer).shape == (9, 2, 4)
        assert pool.get_value_buffer(layer).shape == (9, 2, 6)
        assert pool.get_key_buffer(layer).dtype == dtype
    loc = pool.alloc(3)
    ks = [torch.randn(3, 2, 4) for _ in range(3)]
    vs = [torch.randn(3, 2, 6) for _ in range(3)]
    for layer in range(3):
        pool.set_kv(layer, loc, ks[layer].to(dtype), vs[layer].to(dtype))
    for layer in range(3):
        k, v = pool.get_kv_buffer(layer)
        torch.testing.assert_close(k[loc], ks[layer].to(dtype))
        torch.testing.assert_close(v[loc], vs[layer].to(dtype))
        untouched = torch.ones(9, dtype=torch.bool)
        untouched[loc] = False
        assert not k[untouched].any() and not v[untouched].any()


def test_mha_accepts_flat_heads_and_casts_to_cache_dtype():
    pool = MHAKVPool(8, torch.bfloat16, head_num=2, head_dim=4, layer_num=1, device="cpu")
    loc = torch.tensor([5, 2])
    k = torch.randn(2, 8)
    v = torch.randn(2, 8)
    pool.set_kv(0, loc, k, v)
    torch.testing.assert_close(pool.get_key_buffer(0)[loc], k.view(2, 2, 4).to(torch.bfloat16))
    torch.testing.assert_close(pool.get_value_buffer(0)[loc], v.view(2, 2, 4).to(torch.bfloat16))
    with pytest.raises(ValueError):
        pool.set_kv(0, loc, k, None)


def test_mha_overwrite_and_dummy_slot():
    pool = _mha(size=4)
    loc = torch.tensor([0, 0, 3])  # padded batches all write to slot 0
    pool.set_kv(1, loc, torch.ones(3, 2, 4), torch.ones(3, 2, 4))
    pool.set_kv(1, torch.tensor([3]), torch.full((1, 2, 4), 7.0), torch.full((1, 2, 4), 8.0))
    assert (pool.get_key_buffer(1)[3] == 7).all() and (pool.get_value_buffer(1)[3] == 8).all()
    assert not pool.get_key_buffer(0).any()


def test_mem_usage_and_bytes_per_token_agree():
    pool = MHAKVPool(100, torch.bfloat16, head_num=4, head_dim=8, layer_num=2, device="cpu", v_head_dim=16)
    per_token = mha_kv_bytes_per_token(4, 8, 2, torch.bfloat16, v_head_dim=16)
    assert per_token == 4 * (8 + 16) * 2 * 2
    assert pool.mem_usage_bytes() == per_token * 101
    assert kv_cache_bytes_per_token(2, "bfloat16", head_num=4, head_dim=8, v_head_dim=16) == per_token

    mla = MLAKVPool(100, torch.bfloat16, 32, 8, layer_num=3, device="cpu", kv_cache_dtype="fp8_e4m3")
    per_token = mla_kv_bytes_per_token(32, 8, 3, "fp8_e4m3")
    assert per_token == 40 * 3
    assert mla.mem_usage_bytes() == per_token * 101
    assert kv_cache_bytes_per_token(3, torch.float8_e4m3fn, kv_lora_rank=32, qk_rope_head_dim=8) == per_token

    size = max_tokens_for_budget(per_token * 101, per_token)
    assert size == 100
    assert max_tokens_for_budget(0, per_token) == 0
    with pytest.raises(ValueError):
        kv_cache_bytes_per_token(2, torch.float16, head_num=4)
    with pytest.raises(ValueError):
        kv_cache_bytes_per_token(2, "auto", head_num=4, head_dim=8)


# ---- MLA ----
def test_mla_value_is_a_view_of_the_latent():
    pool = MLAKVPool(8, torch.float32, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=2, device="cpu")
    assert pool.get_key_buffer(1).shape == (9, 1, 8)
    assert pool.get_value_buffer(1).shape == (9, 1, 6)
    loc = pool.alloc(3)
    latent = torch.randn(3, 1, 8)
    pool.set_kv(1, loc, latent, None)
    torch.testing.assert_close(pool.get_key_buffer(1)[loc], latent)
    torch.testing.assert_close(pool.get_value_buffer(1)[loc], latent[..., :6])
    assert pool.get_value_buffer(1).data_ptr() == pool.get_key_buffer(1).data_ptr()
    assert not pool.get_key_buffer(0).any()
    pool.set_kv(0, loc, latent.view(3, 8), None)
    torch.testing.assert_close(pool.get_key_buffer(0)[loc], latent)


# ---- fp8 ----
@pytest.mark.parametrize(
    "name, fp8, rel_tol, k_scale, v_scale",
    # Relative rounding error is at most 2^-(mantissa bits + 1): 2 bits for e5m2 (stored as is), 3 for e4m3.
    [("fp8_e5m2", torch.float8_e5m2, 2 ** -3, 1.0, 1.0), ("fp8_e4m3", torch.float8_e4m3fn, 2 ** -4, 1.0, 1.0),
     ("fp8_e4m3", torch.float8_e4m3fn, 2 ** -4, 4.0, 0.5)],
)
def test_fp8_round_trip(name, fp8, rel_tol, k_scale, v_scale):
    pool = MHAKVPool(16, torch.bfloat16, head_num=2, head_dim=8, layer_num=2, device="cpu",
                     v_head_dim=4, kv_cache_dtype=name)
    pool.set_kv_scales(1, k_scale, v_scale)
    assert pool.kv_scales(1) == (k_scale, v_scale) and pool.kv_scales(0) == (1.0, 1.0)
    assert pool.dtype == torch.bfloat16 and pool.cache_dtype == fp8 and pool.store_dtype == torch.uint8
    loc = pool.alloc(5)
    # Values kept away from the subnormal range so that the relative bound holds.
    gen = torch.Generator().manual_seed(1)
    sign = torch.where(torch.rand(5, 2, 8, generator=gen) < 0.5, -1.0, 1.0)
    k = (sign * (0.1 + 4 * torch.rand(5, 2, 8, generator=gen))).to(torch.bfloat16)
    v = (0.1 + torch.rand(5, 2, 4, generator=gen)).to(torch.bfloat16)
    pool.set_kv(1, loc, k, v)
    kb, vb = pool.get_key_buffer(1), pool.get_value_buffer(1)
    assert kb.dtype == fp8 and vb.dtype == fp8
    k_back = kb[loc].to(torch.float32) * pool.kv_scales(1)[0]
    v_back = vb[loc].to(torch.float32) * pool.kv_scales(1)[1]
    torch.testing.assert_close(k_back, k.float(), rtol=rel_tol, atol=0)
    torch.testing.assert_close(v_back, v.float(), rtol=rel_tol, atol=0)
    assert not pool.get_key_buffer(0).to(torch.float32).any()


def test_kv_scales_per_layer_from_the_constructor_and_their_errors():
    pool = _mha(kv_cache_dtype="fp8_e4m3", k_scale=[0.5, 1.0, 2.0], v_scale=3.0)
    assert [pool.kv_scales(layer) for layer in range(3)] == [(0.5, 3.0), (1.0, 3.0), (2.0, 3.0)]
    with pytest.raises(ValueError, match="one value per layer"):
        _mha(kv_cache_dtype="fp8_e4m3", k_scale=[0.5, 1.0])
    with pytest.raises(ValueError, match="positive finite"):
        pool.set_kv_scales(0, 0.0, 1.0)
    with pytest.raises(ValueError, match="fp8_e4m3 cache only"):
        _mha(kv_cache_dtype="fp8_e5m2").set_kv_scales(0, 2.0, 1.0)
    with pytest.raises(ValueError, match="fp8_e4m3 cache only"):
        _mha(v_scale=2.0)
    mla = MLAKVPool(8, torch.float16, 4, 4, layer_num=2, device="cpu", kv_cache_dtype="fp8_e4m3", kv_scale=[1.0, 2.0])
    assert mla.kv_scales(1) == (2.0, 2.0)
    with pytest.raises(ValueError, match="one scale per layer"):
        mla.set_kv_scales(0, 1.0, 2.0)


def test_fp8_e4m3_saturates_instead_of_overflowing():
    pool = _mha(kv_cache_dtype="fp8_e4m3", k_scale=0.5)
    loc = torch.tensor([2])
    pool.set_kv(0, loc, torch.full((1, 2, 4), 1000.0), torch.full((1, 2, 4), -1e6))
    assert (pool.get_key_buffer(0)[loc].float() == 448).all()  # 1000 / 0.5 is past e4m3's largest value
    assert (pool.get_value_buffer(0)[loc].float() == -448).all()


def test_fp8_mla_round_trip():
    pool = MLAKVPool(8, torch.float16, 4, 4, layer_num=1, device="cpu", kv_cache_dtype=torch.float8_e4m3fn)
    loc = pool.alloc(2)
    latent = torch.tensor([[[0.5, -1.0, 2.0, 0.25, 3.0, -0.75, 1.5, 8.0]]] * 2, dtype=torch.float16)
    pool.set_kv(0, loc, latent, None)
    assert pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    # These values are exact in e4m3.
    assert torch.equal(pool.get_key_buffer(0)[loc].to(torch.float16), latent)
    assert torch.equal(pool.get_value_buffer(0)[loc].to(torch.float16), latent[..., :4])


def test_kv_cache_dtype_resolution_and_bad_arguments():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype(None, torch.float16) == torch.float16
    assert kv_cache_dtype("float32", torch.bfloat16) == torch.float32
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="int4"):
        kv_cache_dtype("int4", torch.bfloat16)
    with pytest.raises(ValueError):
        kv_cache_dtype(torch.int8, torch.bfloat16)
    with pytest.raises(ValueError):
        _mha(size=0)
    with pytest.raises(ValueError):
        MHAKVPool(8, torch.int32, 2, 4, 1, "cpu")
    pool = _mha(kv_cache_dtype="float16")
    assert pool.dtype == torch.float32 and pool.get_key_buffer(0).dtype == torch.float16


# ---- --calculate-kv-scales ----

def test_kv_scales_calibrate_from_each_layers_first_store():
    """Each layer's (k_scale, v_scale) become its first stored batch's max |k|, |v| over an eighth of e4m3's range; the
    values read back are within e4m3 rounding; later stores keep the scales; other caches refuse to calibrate."""
    from braid.runtime.mem_cache.pools import KV_SCALE_CALIBRATION_TARGET

    pool = MHAKVPool(16, torch.float32, head_num=2, head_dim=4, layer_num=2, device="cpu", kv_cache_dtype="fp8_e4m3",
                     k_scale=3.0, v_scale=3.0)
    pool.calibrate_kv_scales_on_next_store()
    assert pool.calibrating_kv_scales
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 8, generator=gen) * 40, torch.randn(5, 8, generator=gen) * 0.01
    loc = pool.alloc(5)
    pool.set_kv(0, loc, k, v)
    assert pool.kv_scales(0) == pytest.approx((k.abs().max().item() / KV_SCALE_CALIBRATION_TARGET,
                                               v.abs().max().item() / KV_SCALE_CALIBRATION_TARGET))
    assert pool.kv_scales(1) == (3.0, 3.0) and pool.calibrating_kv_scales  # layer 1 has stored nothing yet
    k_scale, v_scale = pool.kv_scales(0)
    read_k = pool.get_key_buffer(0)[loc].float() * k_scale
    read_v = pool.get_value_buffer(0)[loc].float() * v_scale
    torch.testing.assert_close(read_k, k.view(5, 2, 4), rtol=2 ** -3, atol=0)
    torch.testing.assert_close(read_v, v.view(5, 2, 4), rtol=2 ** -3, atol=0)  # 1.0 would flush these to subnormals
    pool.set_kv(0, pool.alloc(1), k[:1] * 100, v[:1] * 100)  # larger values later saturate, the scales stay
    assert pool.kv_scales(0) == (k_scale, v_scale)
    pool.set_kv(1, pool.alloc(2), k[:2], v[:2])
    assert not pool.calibrating_kv_scales and pool.kv_scales(1) != (3.0, 3.0)
    for other in ("fp8_e5m2", None):
        with pytest.raises(ValueError, match="needs an fp8_e4m3 KV cache"):
            MHAKVPool(8, torch.float32, 1, 4, 1, "cpu", kv_cache_dtype=other).calibrate_kv_scales_on_next_store()


def test_kv_scale_calibration_in_hybrid_and_mla_pools():
    """The hybrid window pool calibrates window and global layers (through rotate_and_set_kv too) and hands the
    scales to the pool that stores the layer; an MLA latent takes one scale from its latent and rope parts."""
    from braid.runtime.layers.rotary import RotaryEmbedding
    from braid.runtime.mem_cache.pools import KV_SCALE_CALIBRATION_TARGET
    from braid.runtime.mem_cache.window_pool import HybridKVPool

    hybrid = HybridKVPool(32, 16, torch.float32, head_num=1, head_dim=4, layer_windows=[8, None], device="cpu",
                          kv_cache_dtype="fp8_e4m3")
    hybrid.calibrate_kv_scales_on_next_store()
    rotary = RotaryEmbedding(4, 4, 64, 10000.0)
    rotary.build_cache("cpu")
    loc, positions = hybrid.alloc(3), torch.arange(3)
    q, k, v = torch.randn(3, 4), torch.randn(3, 4) * 9, torch.randn(3, 4) * 5
    rotated_k = rotary(positions, q.clone(), k.clone())[1]
    hybrid.rotate_and_set_kv(0, loc, positions, q.clone(), k.clone(), v, rotary)
    hybrid.set_kv(1, loc, k, v)
    assert not hybrid.calibrating_kv_scales
    want = (rotated_k.abs().max().item() / KV_SCALE_CALIBRATION_TARGET, v.abs().max().item() / KV_SCALE_CALIBRATION_TARGET)
    for layer in (0, 1):
        pool, local = hybrid._where[layer]
        assert pool.kv_scales(local) == hybrid.kv_scales(layer)
    assert hybrid.kv_scales(0) == pytest.approx(want)

    mla = MLAKVPool(8, torch.float32, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=1, device="cpu",
                    kv_cache_dtype="fp8_e4m3")
    mla.calibrate_kv_scales_on_next_store()
    latent, rope = torch.randn(2, 6), torch.randn(2, 2) * 30
    mla.set_kv(0, mla.alloc(2), rope, latent)
    scale = max(latent.abs().max().item(), rope.abs().max().item()) / KV_SCALE_CALIBRATION_TARGET
    assert mla.kv_scales(0) == pytest.approx((scale, scale))
