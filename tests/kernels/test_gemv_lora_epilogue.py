"""The batch-1 GEMV with a LoRA adapter's delta in its epilogue (gemv.LoraEpilogue) against the path it replaces:
the GEMV, then the BGMV expand, then the activation or the pool's rotate_and_set_kv. A plain linear, a gated
[gate; up] one and a qkv projection with rotary and the KV write; a row on an adapter and a row on the base model
(slot -1); and, one level up, a Linear carrying a LoraLayer with the GEMV routed to the epilogue against the same
Linear routed to its add_delta.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from braid.runtime.layers import gemv as gemv_module
from braid.runtime.layers.activation import SiluAndMul
from braid.runtime.layers.activation_kernels import silu_and_mul
from braid.runtime.layers.gemv import LoraEpilogue, RotaryKVStore, gemv, gemv_rotary_store
from braid.runtime.layers.linear import ColumnParallelLinear
from braid.runtime.layers.quantization.dense import DenseLinearMethod
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.lora.bgmv_kernels import bgmv_expand, bgmv_shrink
from braid.runtime.lora.manager import LoraBatch, LoraLayer
from braid.runtime.mem_cache import pools
from braid.runtime.mem_cache.pools import MHAKVPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K, RANK, SLOTS = 64, 8, 3


@pytest.fixture(autouse=True)
def kernels_run_here(monkeypatch):
    monkeypatch.setattr(pools, "_triton_kernels_run_on", lambda device: True)


def adapter(outs, dtype, seed):
    """x [1, K], W [sum(outs), K], A [SLOTS, S * RANK, K], B stacked [SLOTS, sum(outs), RANK] with its per-slice
    views, per-slot scales, the rows where slices 1 and 2 start."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device=DEVICE, dtype=dtype)

    x, w = draw(1, K), draw(sum(outs), K, std=K ** -0.5)
    a = draw(SLOTS, len(outs) * RANK, K, std=K ** -0.5)
    b_rows = draw(SLOTS, sum(outs), RANK, std=0.5)
    views = list(b_rows.split(outs, dim=1))
    scale = torch.tensor([0.5, 2.0, 1.25], device=DEVICE, dtype=dtype)
    starts = [sum(outs[:i]) for i in range(1, len(outs))] + [sum(outs)] * 2
    return x, w, a, b_rows, views, scale, (starts[0], starts[1])


def assert_close(got, want, dtype):
    # the fused kernel sums the delta's R products in another order than the expand kernel: one rounding step
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot", [1, -1])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_epilogue_equals_gemv_then_expand(dtype, slot, gated):
    n = 48
    outs = [n, n] if gated else [n]
    x, w, a, b_rows, views, scale, starts = adapter(outs, dtype, seed=7 + gated)
    idx = torch.tensor([slot], device=DEVICE)
    h = bgmv_shrink(x, a, idx)
    config = dict(BLOCK_N=16, BLOCK_K=32, num_warps=1 if DEVICE == "cpu" else 4)

    fused = gemv(x, w, silu_mul=gated, config=config, lora=LoraEpilogue(h, b_rows, scale, idx, starts))
    y = bgmv_expand(gemv(x, w, config=config), h, views, scale, idx)
    want = silu_and_mul(y) if gated else y
    assert fused.shape == (1, n) and fused.dtype == dtype
    assert_close(fused, want, dtype)
    if slot < 0:  # a base-model row: the delta adds nothing
        plain = gemv(x, w, silu_mul=gated, config=config)
        assert torch.equal(fused, plain)
    else:
        assert not torch.allclose(fused.float(), gemv(x, w, silu_mul=gated, config=config).float(), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot", [2, -1])
def test_rotary_store_epilogue_takes_the_delta_before_rotation(dtype, slot):
    h_q, h_kv, d = 4, 2, 16
    outs = [h_q * d, h_kv * d, h_kv * d]
    x, w, a, b_rows, views, scale, starts = adapter(outs, dtype, seed=11)
    idx = torch.tensor([slot], device=DEVICE)
    h = bgmv_shrink(x, a, idx)
    rope = RotaryEmbedding(d, d, 128, 10000.0, is_neox_style=True)
    rope.build_cache(DEVICE)
    fused_pool = MHAKVPool(32, dtype, h_kv, d, 1, DEVICE)
    unfused_pool = MHAKVPool(32, dtype, h_kv, d, 1, DEVICE)
    loc, positions = torch.tensor([5], device=DEVICE), torch.tensor([41], device=DEVICE)

    def store(pool):
        return RotaryKVStore(h_q, h_kv, d, d, positions, rope, target=lambda: pool.rotary_store_target(0, loc),
                             unfused=lambda q, k, v: pool.rotate_and_set_kv(0, loc, positions, q, k, v, rope))

    config = dict(BLOCK_N=4, BLOCK_K=32, num_warps=1 if DEVICE == "cpu" else 4)
    q = gemv_rotary_store(x, w, store(fused_pool), config=config, lora=LoraEpilogue(h, b_rows, scale, idx, starts))
    q_ref = store(unfused_pool)(bgmv_expand(gemv(x, w, config=config), h, views, scale, idx))
    assert q is not None and q.shape == (1, h_q * d)
    assert_close(q, q_ref, dtype)
    assert_close(fused_pool.get_key_buffer(0)[5], unfused_pool.get_key_buffer(0)[5], dtype)
    assert_close(fused_pool.get_value_buffer(0)[5], unfused_pool.get_value_buffer(0)[5], dtype)
    assert torch.count_nonzero(fused_pool.get_key_buffer(0)[6:]) == 0  # no other slot written


def test_fp8_weight_refuses_a_lora_epilogue():
    x, w, a, b_rows, views, scale, starts = adapter([16], torch.bfloat16, seed=3)
    idx = torch.tensor([0], device=DEVICE)
    lora = LoraEpilogue(bgmv_shrink(x, a, idx), b_rows, scale, idx, starts)
    w8 = w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="LoRA epilogue on a dense weight only"):
        gemv(x, w8, weight_scale=torch.ones(16, device=DEVICE), lora=lora)


@pytest.mark.parametrize("outs,act", [([24, 16, 16], None), ([32, 32], SiluAndMul())])
def test_linear_routes_the_delta_into_the_gemv(monkeypatch, outs, act):
    """A Linear with a LoraLayer whose slot 1 holds an adapter set slice by slice: the GEMV-epilogue route (forced
    on for CPU tensors) equals add_delta's route, and differs from the base output."""
    torch.manual_seed(0)
    linear = ColumnParallelLinear(K, outs).to(DEVICE)
    linear.weight.data.normal_(0, K ** -0.5)
    linear.prepack_weights()
    batch = LoraBatch(torch.tensor([0.0, 1.5, 0.0], device=DEVICE))
    layer = LoraLayer(batch, SLOTS, RANK, linear, DEVICE, torch.float32)
    for sub, out in enumerate(outs):  # rank 6 of 8: the padding rows stay zero
        layer.set_slice(1, sub, torch.randn(6, K) * K ** -0.5, torch.randn(out, 6))
    linear.lora = layer
    batch.idx, batch.groups = torch.tensor([1], device=DEVICE), None
    x = torch.randn(1, K, device=DEVICE)

    monkeypatch.setattr(DenseLinearMethod, "takes_lora_epilogue", lambda self, layer, x: False)
    want = linear(x, act)
    monkeypatch.setattr(DenseLinearMethod, "takes_lora_epilogue", lambda self, layer, x: True)
    monkeypatch.setattr(gemv_module, "decode_gemv_applies", lambda x, weight, bias=None: bias is None)
    got = linear(x, act)
    assert_close(got, want, torch.float32)
    batch.idx = torch.tensor([-1], device=DEVICE)
    base = linear(x, act)
    assert not torch.allclose(got, base, atol=1e-3)
