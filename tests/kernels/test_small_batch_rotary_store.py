"""A decode batch's qkv projection with rotary and the KV write as its epilogue, on tensor cores for 2..16 tokens
(small_batch_gemm.small_batch_rotary_store) against the path it replaces: the same tile's plain projection, then the
pool's rotate_and_set_kv. Same q, same cache contents, other slots untouched; split over K or not; GQA with a value
head narrower than the key head; the hybrid window pool's translated slots; the dense Linear's routing; and the cases
it leaves to the unfused path.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest.py); the pool only launches Triton
kernels on CUDA, so the tests let it (`_triton_kernels_run_on`). The `gpu` case takes Gemma-2-9B's shape in a CUDA
graph.
"""

from __future__ import annotations

import pytest
import torch

from braid.runtime.config import ServerArgs
from braid.runtime.layers import small_batch_gemm as small_batch_module
from braid.runtime.layers.gemv import RotaryKVStore
from braid.runtime.layers.kernel_switches import kernel_switches_applied
from braid.runtime.layers.quantization.dense import DenseLinearMethod
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.layers.small_batch_gemm import TcTile, small_batch_gemm, small_batch_rotary_store
from braid.runtime.mem_cache import pools
from braid.runtime.mem_cache.pools import MHAKVPool
from braid.runtime.mem_cache.window_pool import HybridKVPool

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SLOTS, K = 48, 96
TILE = TcTile(64, 32, 4, 1, split_k=1)


@pytest.fixture(autouse=True)
def kernels_run_here(monkeypatch):
    monkeypatch.setattr(pools, "_triton_kernels_run_on", lambda device: True)


def qkv(m, h, h_kv, d, dv, seed, k=K):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn((h + h_kv) * d + h_kv * dv, k, generator=gen) / k ** 0.5).to(device=DEVICE,
                                                                                  dtype=torch.bfloat16)
    return x, w


def epilogue(pool, layer_id, loc, positions, rope, h, h_kv, d, dv):
    return RotaryKVStore(h, h_kv, d, dv, positions, rope, target=lambda: pool.rotary_store_target(layer_id, loc),
                         unfused=lambda q, k, v: pool.rotate_and_set_kv(layer_id, loc, positions, q, k, v, rope))


def rope_of(d, rotary_dim=None, neox=True):
    rope = RotaryEmbedding(d, rotary_dim or d, 256, 10000.0, is_neox_style=neox)
    rope.build_cache(DEVICE)
    return rope


def caches(pool):
    return [b.clone() for i in range(pool.layer_num) for b in (pool.get_key_buffer(i), pool.get_value_buffer(i))]


def assert_same(a, b):
    # exact on the CPU (both paths interpreted, the same tile); on a GPU the two rotations may contract
    # x1 * cos - x2 * sin differently: one bf16 rounding step at most
    tol = 0 if DEVICE == "cpu" else 2 ** -7
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("m", [2, 5])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("h,h_kv,d,dv", [(4, 2, 128, 64), (2, 2, 128, 128)])
def test_epilogue_equals_projection_then_rotate_and_store(m, split, h, h_kv, d, dv):
    x, w = qkv(m, h, h_kv, d, dv, seed=m * 10 + split + h)
    rope = rope_of(d)
    fused = MHAKVPool(SLOTS, torch.bfloat16, h_kv, d, 2, DEVICE, v_head_dim=dv)
    unfused = MHAKVPool(SLOTS, torch.bfloat16, h_kv, d, 2, DEVICE, v_head_dim=dv)
    loc = torch.tensor([29, 3, 17, 40, 8][:m], device=DEVICE)
    positions = torch.tensor([77, 5, 130, 0, 201][:m], device=DEVICE)
    tile = TcTile(64, 32, 4, 1, split_k=split)

    q = small_batch_rotary_store(x, w, epilogue(fused, 1, loc, positions, rope, h, h_kv, d, dv), tile=tile)
    q_ref = epilogue(unfused, 1, loc, positions, rope, h, h_kv, d, dv)(small_batch_gemm(x, w, tile=tile))
    assert q is not None and q.shape == (m, h * d) and q.dtype == torch.bfloat16
    assert_same(q, q_ref)
    for got, want in zip(caches(fused), caches(unfused)):
        assert_same(got, want)
    assert fused.get_key_buffer(1)[loc].ne(0).any(-1).any(-1).all()
    assert fused.get_value_buffer(1)[loc].ne(0).any(-1).any(-1).all()
    others = torch.ones(SLOTS + 1, dtype=torch.bool)
    others[loc.cpu()] = False
    assert not fused.get_key_buffer(1)[others].any() and not fused.get_key_buffer(0).any()
    # the rotation is real: at position 0 q is the plain projection
    q0 = small_batch_rotary_store(x, w, epilogue(fused, 1, loc, torch.zeros_like(positions), rope, h, h_kv, d, dv),
                                  tile=tile)
    assert_same(q0, small_batch_gemm(x, w, tile=tile)[:, :h * d])
    assert not torch.equal(q0, q)


def test_hybrid_pool_writes_window_layers_at_their_translated_slots():
    h, h_kv, d = 2, 1, 128
    x, w = qkv(3, h, h_kv, d, d, seed=11)
    rope = rope_of(d)
    made = [HybridKVPool(SLOTS, 24, torch.bfloat16, h_kv, d, [16, None], DEVICE) for _ in range(2)]
    locs = []
    for pool in made:
        pool.release_window(pool.alloc(20)[:15])  # full slots and window slots part ways
        locs.append(pool.alloc(6)[-3:])
    assert torch.equal(locs[0], locs[1])
    window_slots = made[0].full_to_window[locs[0]]
    assert not torch.equal(window_slots.to(locs[0].dtype), locs[0])
    positions = torch.tensor([19, 20, 21], device=DEVICE)
    for layer_id in (0, 1):  # the window layer, then the global one
        q = small_batch_rotary_store(x, w, epilogue(made[0], layer_id, locs[0], positions, rope, h, h_kv, d, d),
                                     tile=TILE)
        q_ref = epilogue(made[1], layer_id, locs[1], positions, rope, h, h_kv, d, d)(small_batch_gemm(x, w, tile=TILE))
        assert q is not None
        assert_same(q, q_ref)
    for got, want in zip(caches(made[0].window_pool) + caches(made[0].full_pool),
                         caches(made[1].window_pool) + caches(made[1].full_pool)):
        assert_same(got, want)
    assert made[0].window_pool.get_key_buffer(0)[window_slots].ne(0).any(-1).any(-1).all()


def test_dense_method_routes_small_batches_with_a_measured_rotary_tile(monkeypatch):
    """DenseLinearMethod hands a RotaryKVStore act at 2..16 rows to small_batch_rotary_store, which takes the tile
    measured for the shape under "rotary"; with the decode GEMVs switched off (ServerArgs.disable_decode_gemv) the
    projection and the pool's rotate_and_set_kv run as before, with the same result within bf16 rounding."""
    h, h_kv, d = 2, 1, 128
    x, w = qkv(4, h, h_kv, d, d, seed=5)
    rope = rope_of(d)
    layer = torch.nn.Module()
    layer.weight, layer.cpu_packed_weight = torch.nn.Parameter(w, requires_grad=False), None
    monkeypatch.setattr(small_batch_module, "measured_tile", lambda device, rows, k, activation, x_rows:
                        TILE if (rows, k, activation) == tuple(w.shape) + ("rotary",) and 2 <= x_rows <= 8 else None)
    launched = []
    real = small_batch_module.small_batch_rotary_store
    monkeypatch.setattr(small_batch_module, "small_batch_rotary_store",
                        lambda *a, **kw: launched.append(real(*a, **kw)) or launched[-1])
    method = DenseLinearMethod()
    positions, loc = torch.tensor([41, 3, 9, 12], device=DEVICE), torch.tensor([3, 4, 5, 6], device=DEVICE)
    results = []
    for switches in (ServerArgs(), ServerArgs(disable_decode_gemv=True)):
        pool = MHAKVPool(SLOTS, torch.bfloat16, h_kv, d, 1, DEVICE)
        with kernel_switches_applied(switches):
            q = method.apply(layer, x, act=epilogue(pool, 0, loc, positions, rope, h, h_kv, d, d))
        results.append((q, caches(pool)))
    assert launched[0] is not None and launched[1] is None
    for got, want in zip([results[0][0]] + results[0][1], [results[1][0]] + results[1][1]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert results[0][1][0][loc].ne(0).any()


@pytest.mark.parametrize("case", ["interleaved", "partial", "fp8 cache", "block_n over half a head", "one token",
                                  "switched off", "positions for other tokens"])
def test_cases_left_to_the_unfused_path(case):
    h, h_kv = 2, 1
    d = 64 if case == "block_n over half a head" else 128
    x, w = qkv(1 if case == "one token" else 3, h, h_kv, d, d, seed=3)
    rope = rope_of(d, rotary_dim=d // 2 if case == "partial" else None, neox=case != "interleaved")
    pool = MHAKVPool(SLOTS, torch.bfloat16, h_kv, d, 1, DEVICE,
                     kv_cache_dtype="fp8_e5m2" if case == "fp8 cache" else None,
                     gemv_rotary_store=case != "switched off")
    tokens = 2 if case == "positions for other tokens" else x.shape[0]
    loc, positions = torch.arange(5, 5 + tokens, device=DEVICE), torch.arange(9, 9 + tokens, device=DEVICE)
    before = caches(pool)
    assert small_batch_rotary_store(x, w, epilogue(pool, 0, loc, positions, rope, h, h_kv, d, d), tile=TILE) is None
    for got, want in zip(caches(pool), before):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tile", [TcTile(64, 128, 4, 4), TcTile(64, 64, 4, 4), TcTile(128, 128, 4, 3),
                                  TcTile(64, 128, 4, 2, split_k=1)])
def test_gpu_gemma2_shape_in_a_cuda_graph(tile):
    """Gemma-2-9B's qkv (16 q heads, 8 KV heads of 256, K = 3584) at 8 tokens, captured and replayed in a CUDA graph:
    the split-K counters are back at zero between replays, and every replay equals the unfused path."""
    from triton.runtime.errors import OutOfResources

    h, h_kv, d, k, m = 16, 8, 256, 3584, 8
    x, w = qkv(m, h, h_kv, d, d, seed=7, k=k)
    rope = RotaryEmbedding(d, d, 8192, 10000.0, is_neox_style=True)
    rope.build_cache("cuda")
    fused = MHAKVPool(64, torch.bfloat16, h_kv, d, 1, "cuda")
    unfused = MHAKVPool(64, torch.bfloat16, h_kv, d, 1, "cuda")
    loc = torch.tensor([3, 9, 12, 20, 33, 41, 50, 63], device="cuda")
    positions = torch.tensor([5, 100, 2000, 4095, 7, 8000, 1, 0], device="cuda")
    q_ref = epilogue(unfused, 0, loc, positions, rope, h, h_kv, d, d)(torch.nn.functional.linear(x, w))
    store = epilogue(fused, 0, loc, positions, rope, h, h_kv, d, d)
    try:
        first = small_batch_rotary_store(x, w, store, tile=tile)
    except OutOfResources:  # over this GPU's shared memory (TcTile(128, 128, 4, 3): 272 KB, an H100 has 227 KB)
        assert torch.cuda.get_device_properties(0).shared_memory_per_block_optin < 272 * 1024
        return
    assert first is not None
    torch.testing.assert_close(first.float(), q_ref.float(), rtol=2e-2, atol=2e-2)
    for got, want in zip(caches(fused), caches(unfused)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_batch_rotary_store(x, w, store, tile=tile)
    written = caches(fused)
    for _ in range(2):
        fused.get_key_buffer(0).zero_()
        fused.get_value_buffer(0).zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
        for got, want in zip(caches(fused), written):
            assert torch.equal(got, want)
