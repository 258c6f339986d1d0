"""The batch-1 qkv GEMV with rotary and the KV write as its epilogue (gemv.gemv_rotary_store, and on an e4m3 weight
fp8_gemv.fp8_gemv_rotary_store) against the path it replaces: the GEMV, then the pool's rotate_and_set_kv (rotary +
store kernel). Same q, same cache contents, other slots untouched; every program layout (BLOCK_N 2..16), GQA, a value
head narrower than the key head, the hybrid window pool's translated slots; and the cases it leaves to the unfused
path.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest.py); the pool only launches Triton
kernels on CUDA, so the tests let it (`_triton_kernels_run_on`).
"""

from __future__ import annotations

import pytest
import torch

from braid.runtime.layers import gemv as gemv_module
from braid.runtime.layers.gemv import RotaryKVStore, gemv, gemv_rotary_store
from braid.runtime.layers.quantization import fp8 as fp8_module
from braid.runtime.layers.quantization.dense import DenseLinearMethod
from braid.runtime.layers.quantization.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_rotary_store
from braid.runtime.layers.quantization.fp8_quantize import quantize_weight_per_channel
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.mem_cache import pools
from braid.runtime.mem_cache.pools import MHAKVPool
from braid.runtime.mem_cache.window_pool import HybridKVPool
from kv_pools import PoolWithoutEpilogueTarget

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS, K = 48, 96


@pytest.fixture(autouse=True)
def kernels_run_here(monkeypatch):
    monkeypatch.setattr(pools, "_triton_kernels_run_on", lambda device: True)


def qkv_weight(h, h_kv, d, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=gen).to(device=DEVICE, dtype=dtype)
    w = (torch.randn((h + h_kv) * d + h_kv * dv, K, generator=gen) / K ** 0.5).to(device=DEVICE, dtype=dtype)
    return x, w


def epilogue(pool, layer_id, loc, position, rope, h, h_kv, d, dv):
    positions = torch.tensor([position], device=DEVICE)
    return RotaryKVStore(h, h_kv, d, dv, positions, rope, target=lambda: pool.rotary_store_target(layer_id, loc),
                         unfused=lambda q, k, v: pool.rotate_and_set_kv(layer_id, loc, positions, q, k, v, rope))


def rope_of(d, rotary_dim=None, neox=True):
    rope = RotaryEmbedding(d, rotary_dim or d, 128, 10000.0, is_neox_style=neox)
    rope.build_cache(DEVICE)
    return rope


def caches(pool):
    return [b.clone() for i in range(pool.layer_num) for b in (pool.get_key_buffer(i), pool.get_value_buffer(i))]


def assert_same(a, b, dtype):
    # exact on the CPU (both kernels interpreted); on a GPU the two kernels may contract x1 * cos - x2 * sin
    # differently: one rounding step of the dtype at most
    tol = 0 if DEVICE == "cpu" else 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,h_kv,d,dv", [(4, 2, 32, 32), (2, 2, 16, 16), (6, 2, 32, 16)])
@pytest.mark.parametrize("block_n", [2, 4, 16])
def test_epilogue_equals_gemv_then_rotate_and_store(dtype, h, h_kv, d, dv, block_n):
    x, w = qkv_weight(h, h_kv, d, dv, dtype, seed=h * 100 + d + block_n)
    rope = rope_of(d)
    fused = MHAKVPool(SLOTS, dtype, h_kv, d, 2, DEVICE, v_head_dim=dv)
    unfused = MHAKVPool(SLOTS, dtype, h_kv, d, 2, DEVICE, v_head_dim=dv)
    loc, position = torch.tensor([29], device=DEVICE), 77
    config = dict(BLOCK_N=block_n, BLOCK_K=32, num_warps=1 if DEVICE == "cpu" else 4)

    q = gemv_rotary_store(x, w, epilogue(fused, 1, loc, position, rope, h, h_kv, d, dv), config=config)
    q_ref = epilogue(unfused, 1, loc, position, rope, h, h_kv, d, dv)(gemv(x, w, config=config))
    assert q.shape == (1, h * d) and q.dtype == dtype
    assert_same(q, q_ref, dtype)
    for got, want in zip(caches(fused), caches(unfused)):
        assert_same(got, want, dtype)
    written = fused.get_key_buffer(1)[29]
    assert written.abs().sum() > 0 and fused.get_value_buffer(1)[29].abs().sum() > 0
    others = torch.ones(SLOTS + 1, dtype=torch.bool)
    others[29] = False
    assert not fused.get_key_buffer(1)[others].any() and not fused.get_key_buffer(0).any()
    # the rotation is real: position 0 leaves q as the plain projection
    q0 = gemv_rotary_store(x, w, epilogue(fused, 1, loc, 0, rope, h, h_kv, d, dv), config=config)
    assert_same(q0, gemv(x, w, config=config)[:, :h * d], dtype)
    assert not torch.equal(q0, q)


def test_autotuned_epilogue_and_the_dense_method_route_to_it(monkeypatch):
    """DenseLinearMethod hands a RotaryKVStore act to the fused kernel wherever the batch-1 GEMV applies, and the
    autotuned launch equals the unfused path."""
    h, h_kv, d, dv, dtype = 4, 2, 32, 32, torch.bfloat16
    x, w = qkv_weight(h, h_kv, d, dv, dtype, seed=5)
    rope = rope_of(d)
    fused = MHAKVPool(SLOTS, dtype, h_kv, d, 1, DEVICE)
    unfused = PoolWithoutEpilogueTarget(SLOTS, dtype, h_kv, d, 1, DEVICE)
    loc = torch.tensor([3], device=DEVICE)
    layer = torch.nn.Module()
    layer.weight, layer.cpu_packed_weight = torch.nn.Parameter(w, requires_grad=False), None
    monkeypatch.setattr(gemv_module, "decode_gemv_applies", lambda x, weight, bias=None: True)
    launched = []
    real = gemv_module.gemv_rotary_store
    monkeypatch.setattr(gemv_module, "gemv_rotary_store", lambda *a, **kw: launched.append(real(*a, **kw))
                        or launched[-1])
    method = DenseLinearMethod()
    q = method.apply(layer, x, act=epilogue(fused, 0, loc, 41, rope, h, h_kv, d, dv))
    q_ref = method.apply(layer, x, act=epilogue(unfused, 0, loc, 41, rope, h, h_kv, d, dv))
    assert launched[0] is not None and launched[1] is None  # the second pool keeps the store to itself
    assert_same(q, q_ref, dtype)
    for got, want in zip(caches(fused), caches(unfused)):
        assert_same(got, want, dtype)


def test_hybrid_pool_writes_window_layers_at_their_translated_slots():
    dtype, h, h_kv, d = torch.bfloat16, 2, 1, 32
    x, w = qkv_weight(h, h_kv, d, d, dtype, seed=11)
    rope = rope_of(d)
    made = [HybridKVPool(SLOTS, 24, dtype, h_kv, d, [16, None], DEVICE) for _ in range(2)]
    locs = []
    for pool in made:
        pool.release_window(pool.alloc(20)[:15])  # full slots and window slots part ways
        locs.append(pool.alloc(6)[-1:])
    assert torch.equal(locs[0], locs[1])
    window_slot = int(made[0].full_to_window[locs[0]])
    assert window_slot != int(locs[0])
    for layer_id in (0, 1):  # the window layer, then the global one
        q = gemv_rotary_store(x, w, epilogue(made[0], layer_id, locs[0], 19, rope, h, h_kv, d, d))
        q_ref = epilogue(made[1], layer_id, locs[1], 19, rope, h, h_kv, d, d)(gemv(x, w))
        assert q is not None
        assert_same(q, q_ref, dtype)
    for got, want in zip(caches(made[0].window_pool) + caches(made[0].full_pool),
                         caches(made[1].window_pool) + caches(made[1].full_pool)):
        assert_same(got, want, dtype)
    assert made[0].window_pool.get_key_buffer(0)[window_slot].abs().sum() > 0


@pytest.mark.parametrize("case", ["interleaved", "partial", "fp8 cache", "head_dim 8", "two tokens", "no target"])
def test_cases_left_to_the_unfused_path(case):
    h, h_kv, d = 2, 1, 8 if case == "head_dim 8" else 32
    dtype = torch.bfloat16
    x, w = qkv_weight(h, h_kv, d, d, dtype, seed=3)
    rope = rope_of(d, rotary_dim=d // 2 if case == "partial" else None, neox=case != "interleaved")
    pool = (PoolWithoutEpilogueTarget if case == "no target" else MHAKVPool)(
        SLOTS, dtype, h_kv, d, 1, DEVICE, kv_cache_dtype="fp8_e5m2" if case == "fp8 cache" else None)
    loc = torch.tensor([5, 6] if case == "two tokens" else [5], device=DEVICE)
    store = epilogue(pool, 0, loc, 9, rope, h, h_kv, d, d)
    if case == "two tokens":
        store = RotaryKVStore(h, h_kv, d, d, torch.tensor([9, 10], device=DEVICE), rope, store.target, store.unfused)
    before = caches(pool)
    assert gemv_rotary_store(x, w, store) is None
    for got, want in zip(caches(pool), before):
        assert torch.equal(got, want)  # nothing written


# ---- the same epilogue on an e4m3 weight with row scales (fp8_gemv.fp8_gemv_rotary_store, the "f16" products)


def fp8_qkv_weight(h, h_kv, d, dv, seed):
    x, w = qkv_weight(h, h_kv, d, dv, torch.bfloat16, seed)
    w_q, scale = quantize_weight_per_channel(w)
    return x, w_q, scale


@pytest.mark.parametrize("h,h_kv,d,dv,block_n", [(4, 2, 32, 32, 2), (6, 2, 32, 16, 4), (6, 2, 32, 16, 2)])
def test_fp8_epilogue_equals_fp8_gemv_then_rotate_and_store(h, h_kv, d, dv, block_n):
    # one and two pairs a program, GQA, a value head narrower than the key head
    x, w_q, scale = fp8_qkv_weight(h, h_kv, d, dv, seed=h * 10 + dv + block_n)
    rope = rope_of(d)
    dtype = torch.bfloat16
    fused = MHAKVPool(SLOTS, dtype, h_kv, d, 2, DEVICE, v_head_dim=dv)
    unfused = MHAKVPool(SLOTS, dtype, h_kv, d, 2, DEVICE, v_head_dim=dv)
    loc, position = torch.tensor([17], device=DEVICE), 45
    config = Fp8GemvConfig("f16", block_n, 32, 1 if DEVICE == "cpu" else 4, 1, group=8)

    q = fp8_gemv_rotary_store(x, w_q, scale, epilogue(fused, 1, loc, position, rope, h, h_kv, d, dv), config=config)
    y = fp8_gemv(x, w_q, scale, config=config)
    q_ref = epilogue(unfused, 1, loc, position, rope, h, h_kv, d, dv)(y.clone())  # (rotates y's q part in place)
    assert q.shape == (1, h * d) and q.dtype == dtype
    assert_same(q, q_ref, dtype)
    for got, want in zip(caches(fused), caches(unfused)):
        assert_same(got, want, dtype)
    assert fused.get_key_buffer(1)[17].abs().sum() > 0 and fused.get_value_buffer(1)[17].abs().sum() > 0
    # the v rows went to the cache unrotated: the projection's own v columns
    assert_same(fused.get_value_buffer(1)[17].reshape(1, -1), y[:, (h + h_kv) * d:], dtype)
    # the rotation is real: position 0 leaves q as the plain projection
    q0 = fp8_gemv_rotary_store(x, w_q, scale, epilogue(fused, 1, loc, 0, rope, h, h_kv, d, dv), config=config)
    assert_same(q0, y[:, :h * d], dtype)
    assert not torch.equal(q0, q)


@pytest.mark.parametrize("case", ["tensor-core config", "pairs not dividing a half head", "fp8 cache", "bf16 weight"])
def test_fp8_epilogue_leaves_to_the_unfused_path(case):
    h, h_kv, d = 2, 1, 24 if case == "pairs not dividing a half head" else 32
    x, w_q, scale = fp8_qkv_weight(h, h_kv, d, d, seed=8)
    pool = MHAKVPool(SLOTS, torch.bfloat16, h_kv, d, 1, DEVICE,
                     kv_cache_dtype="fp8_e5m2" if case == "fp8 cache" else None)
    store = epilogue(pool, 0, torch.tensor([5], device=DEVICE), 9, rope_of(d), h, h_kv, d, d)
    config = (Fp8GemvConfig("tc", 64, 32, 4, 1, split_k=0) if case == "tensor-core config"
              else Fp8GemvConfig("f16", 16 if case == "pairs not dividing a half head" else 4, 32, 1, 1, group=8))
    if case == "bf16 weight":
        w_q = w_q.to(torch.bfloat16)
    before = caches(pool)
    assert fp8_gemv_rotary_store(x, w_q, scale, store, config=config) is None
    for got, want in zip(caches(pool), before):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_fp8_method_routes_a_decode_qkv_to_the_fused_kernel(monkeypatch):
    """Fp8LinearMethod at one row on CUDA: a RotaryKVStore act runs fp8_gemv_rotary_store (the shape's measured or
    first f16 config), equal to the pool that keeps the store to itself (GEMV, then rotary + store)."""
    h, h_kv, d = 32, 8, 128
    x, w_q, scale = fp8_qkv_weight(h, h_kv, d, d, seed=2)
    rope = rope_of(d)
    fused = MHAKVPool(SLOTS, torch.bfloat16, h_kv, d, 1, DEVICE)
    unfused = PoolWithoutEpilogueTarget(SLOTS, torch.bfloat16, h_kv, d, 1, DEVICE)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w_q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.input_scale, layer.fp8_tensorwise = None, False
    launched = []
    real = fp8_module.fp8_gemv_rotary_store
    monkeypatch.setattr(fp8_module, "fp8_gemv_rotary_store", lambda *a, **kw: launched.append(real(*a, **kw))
                        or launched[-1])
    method = fp8_module.Fp8LinearMethod()
    loc = torch.tensor([7], device=DEVICE)
    q = method.apply(layer, x, act=epilogue(fused, 0, loc, 300, rope, h, h_kv, d, d))
    q_ref = method.apply(layer, x, act=epilogue(unfused, 0, loc, 300, rope, h, h_kv, d, d))
    assert launched[0] is not None and launched[1] is None
    assert_same(q, q_ref, torch.bfloat16)
    for got, want in zip(caches(fused), caches(unfused)):
        assert_same(got, want, torch.bfloat16)
