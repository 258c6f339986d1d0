"""Fused RMSNorm / activation / rotary Triton kernels vs the layers' PyTorch paths (`forward_native`).

The small cases run compiled on a GPU when there is one, else under TRITON_INTERPRET=1 on CPU tensors
(set in conftest.py). The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest, so there
bf16 results differ from the reference by up to one bf16 ulp per element; the relative-norm tolerance
covers it. The cases marked `gpu` use Llama-3-8B shapes and need CUDA.
"""

from __future__ import annotations

import pytest
import torch

from braid.runtime.layers import activation_kernels, kv_store_kernels, norm_kernels, rotary_kernels
from braid.runtime.layers.activation import GeluAndMul, SiluAndMul
from braid.runtime.layers.activation_kernels import gelu_and_mul, silu_and_mul
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.norm_kernels import fused_add_rmsnorm, rmsnorm
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.layers.rotary_kernels import apply_rotary

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # the small cases run compiled on a GPU, interpreted without one
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def tol(dtype):
    return {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


def rel_err(out, ref):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_norm(hidden, dtype, device=DEVICE, unit_offset=False, eps=1e-6):
    norm = RMSNorm(hidden, eps, add_unit_offset=unit_offset).to(device)
    norm.weight.data = (torch.randn(hidden, device=device) * 0.5 + (0.0 if unit_offset else 1.0)).to(dtype)
    return norm


def make_rope(head_dim, rotary_dim, max_pos, neox, device=DEVICE, scaling=None):
    rope = RotaryEmbedding(head_dim, rotary_dim, max_pos, 500000.0, scaling, is_neox_style=neox)
    rope.build_cache(device)
    return rope


def qkv_views(tokens, heads, kv_heads, head_dim, dtype, device=DEVICE):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return qkv, q, k, v


# ------------------------------------------------------------------------------------ CPU (interpreter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rmsnorm_matches_reference(dtype, unit_offset):
    torch.manual_seed(0)
    norm = make_norm(96, dtype, unit_offset=unit_offset)
    x = torch.randn(5, 96, dtype=dtype, device=DEVICE) * 3
    assert rel_err(rmsnorm(x, norm.weight, norm.eps, unit_offset), norm.forward_native(x)) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_fused_add_rmsnorm_matches_reference(dtype, unit_offset):
    torch.manual_seed(1)
    norm = make_norm(80, dtype, unit_offset=unit_offset)
    x, residual = (torch.randn(6, 80, dtype=dtype, device=DEVICE) for _ in range(2))
    x_before, res_before = x.clone(), residual.clone()
    out, summed = fused_add_rmsnorm(x, residual, norm.weight, norm.eps, unit_offset)
    ref_out, ref_sum = norm.forward_native(x, residual)
    assert rel_err(out, ref_out) < tol(dtype)
    assert rel_err(summed, ref_sum) < tol(dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


def test_fused_add_rmsnorm_in_place_on_strided_rows():
    torch.manual_seed(2)
    norm = make_norm(48, torch.float32)
    wide = torch.randn(4, 100, device=DEVICE)
    x = wide[:, 10:58]  # rows strided by 100
    residual = torch.randn(4, 48, device=DEVICE)
    ref_out, ref_sum = norm.forward_native(x.clone(), residual.clone())
    out, summed = fused_add_rmsnorm(x, residual, norm.weight, norm.eps, residual_out=residual)
    assert summed is residual
    assert rel_err(residual, ref_sum) < 1e-6
    assert rel_err(out, ref_out) < 1e-5


def test_rmsnorm_3d_input_and_out_over_x():
    torch.manual_seed(3)
    norm = make_norm(32, torch.float32)
    x = torch.randn(2, 3, 32, device=DEVICE)
    ref = norm.forward_native(x)
    out = rmsnorm(x, norm.weight, norm.eps, out=x)
    assert out is x and rel_err(x, ref) < 1e-5


@pytest.mark.parametrize("has_residual", [False, True])
def test_rmsnorm_two_pass_path(monkeypatch, has_residual):
    # rows wider than the register tile are normalised in chunks, re-reading the stored sum
    monkeypatch.setattr(norm_kernels, "RMSNORM_MAX_TILE", 32)
    monkeypatch.setattr(norm_kernels, "RMSNORM_CHUNK", 32)
    torch.manual_seed(4)
    norm = make_norm(80, torch.float32, unit_offset=True)
    x, residual = torch.randn(3, 80, device=DEVICE), torch.randn(3, 80, device=DEVICE)
    if has_residual:
        ref_out, ref_sum = norm.forward_native(x, residual.clone())
        out, summed = fused_add_rmsnorm(x, residual, norm.weight, norm.eps, True, residual_out=residual)
        assert rel_err(summed, ref_sum) < 1e-6
    else:
        ref_out, out = norm.forward_native(x), rmsnorm(x, norm.weight, norm.eps, True)
    assert rel_err(out, ref_out) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype, monkeypatch):
    monkeypatch.setattr(activation_kernels, "ACT_BLOCK", 16)  # several column blocks per row
    torch.manual_seed(5)
    x = torch.randn(4, 2 * 40, dtype=dtype, device=DEVICE) * 4
    assert rel_err(silu_and_mul(x), SiluAndMul().forward_native(x)) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_and_mul_matches_reference(dtype, approximate):
    torch.manual_seed(6)
    x = torch.randn(2, 3, 2 * 24, dtype=dtype, device=DEVICE) * 4
    # tanh saturation and near zero
    x[0, 0, :4] = torch.tensor([-30.0, 30.0, 0.0, 1e-3], dtype=dtype, device=DEVICE)
    out = gelu_and_mul(x, approximate)
    assert out.shape == (2, 3, 24)
    assert rel_err(out, GeluAndMul(approximate).forward_native(x)) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_matches_reference(dtype, neox, rotary_dim, inplace):
    torch.manual_seed(7)
    rope = make_rope(16, rotary_dim, 64, neox, scaling={"rope_type": "linear", "factor": 2.0})
    qkv, q, k, v = qkv_views(5, 4, 2, 16, dtype)
    v_before = v.clone()
    positions = torch.tensor([0, 63, 7, 7, 31], device=DEVICE)
    ref_q, ref_k = rope.forward_native(positions, q, k)
    out_q, out_k = apply_rotary(positions, q, k, rope.cos_sin_cache, 16, rotary_dim, neox, inplace=inplace)
    assert rel_err(out_q, ref_q) < tol(dtype)
    assert rel_err(out_k, ref_k) < tol(dtype)
    if inplace:
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
        assert torch.equal(v, v_before)


def test_rotary_int32_positions_and_3d_strided_heads():
    # [T, H, rope_dim] slices of [T, H, nope + rope] (MLA-style), with int32 positions
    torch.manual_seed(8)
    rope = make_rope(8, 8, 32, neox=False)
    q_full, k_full = torch.randn(3, 4, 24, device=DEVICE), torch.randn(3, 1, 24, device=DEVICE)
    q_pe, k_pe = q_full[..., 16:], k_full[..., 16:]
    positions = torch.tensor([5, 0, 31], dtype=torch.int32, device=DEVICE)
    ref_q, ref_k = rope.forward_native(positions.long(), q_pe, k_pe)
    nope_before = q_full[..., :16].clone()
    out_q, out_k = apply_rotary(positions, q_pe, k_pe, rope.cos_sin_cache, 8, 8, is_neox_style=False,
                                inplace=True)
    assert rel_err(out_q.reshape(3, -1), ref_q) < 1e-5
    assert rel_err(out_k.reshape(3, -1), ref_k) < 1e-5
    assert torch.equal(q_full[..., :16], nope_before)


def test_empty_batch():
    norm = make_norm(16, torch.float32)
    x = torch.empty(0, 16, device=DEVICE)
    assert rmsnorm(x, norm.weight, 1e-6).shape == (0, 16)
    assert fused_add_rmsnorm(x, x.clone(), norm.weight, 1e-6)[1].shape == (0, 16)
    assert silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
    rope = make_rope(8, 8, 4, True)
    positions = torch.empty(0, dtype=torch.long, device=DEVICE)
    q, k = apply_rotary(positions, torch.empty(0, 16, device=DEVICE), torch.empty(0, 8, device=DEVICE),
                        rope.cos_sin_cache, 8)
    assert q.shape == (0, 16) and k.shape == (0, 8)


def test_bad_inputs_raise_value_error():
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(torch.randn(2, 8, device=DEVICE), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(torch.randn(2, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE), w, 1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="approximate"):
        gelu_and_mul(torch.randn(2, 8, device=DEVICE), approximate="sigmoid")
    cache = make_rope(8, 8, 4, True).cos_sin_cache
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    q8, k8, q12 = (torch.randn(2, n, device=DEVICE) for n in (8, 8, 12))
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(pos, q8, k8, cache, 8, rotary_dim=10)
    with pytest.raises(ValueError, match="heads"):
        apply_rotary(pos, q12, k8, cache, 8)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(pos, q8, k8, cache[:, :4], 8)


# ------------------------------------------------------------------------------ GPU (Llama-3-8B shapes)

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
GPU_TOKENS = [1, 64, 4096]


def cuda_kernel_launches(fn) -> int:
    """Number of GPU kernels `fn()` launches (CUDA graph capture would hide them; the profiler does not)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS + [16384])
@pytest.mark.parametrize("has_residual", [False, True])
def test_gpu_rmsnorm(tokens, has_residual):
    torch.manual_seed(10)
    norm = make_norm(HIDDEN, torch.bfloat16, "cuda")
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x) if has_residual else None
    args = (x,) if residual is None else (x, residual)
    ref = norm.forward_native(*args)
    out = norm(*args)
    if has_residual:
        assert torch.equal(out[1], ref[1])  # the bf16 sum rounds the same way
        assert rel_err(out[0], ref[0]) < 1e-2
    else:
        assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
def test_gpu_rmsnorm_fp32_gemma_offset(tokens):
    torch.manual_seed(11)
    norm = make_norm(HIDDEN, torch.float32, "cuda", unit_offset=True)
    x, residual = (torch.randn(tokens, HIDDEN, device="cuda") for _ in range(2))
    out, summed = norm(x, residual)
    ref_out, ref_sum = norm.forward_native(x, residual)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(summed, ref_sum) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
@pytest.mark.parametrize("layer", [SiluAndMul(), GeluAndMul("tanh")], ids=["silu", "gelu_tanh"])
def test_gpu_act_and_mul(tokens, layer):
    torch.manual_seed(12)
    x = torch.randn(tokens, 2 * INTER, dtype=torch.bfloat16, device="cuda") * 3
    assert rel_err(layer(x), layer.forward_native(x)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS + [16384])
@pytest.mark.parametrize("neox", [True, False])
def test_gpu_rotary_in_place_on_qkv_views(tokens, neox):
    torch.manual_seed(13)
    rope = make_rope(HEAD_DIM, HEAD_DIM, 131072, neox, "cuda", LLAMA3_SCALING)
    qkv, q, k, v = qkv_views(tokens, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    v_before = v.clone()
    positions = torch.randint(0, 131072, (tokens,), device="cuda")
    ref_q, ref_k = rope.forward_native(positions, q, k)
    out_q, out_k = rope(positions, q, k)
    assert rel_err(out_q, ref_q) < 1e-2 and rel_err(out_k, ref_k) < 1e-2
    assert torch.equal(v, v_before)


@pytest.mark.gpu
def test_gpu_rotary_partial_out_of_place_fp16():
    torch.manual_seed(14)
    rope = make_rope(HEAD_DIM, 64, 4096, True, "cuda")
    _, q, k, _ = qkv_views(64, HEADS, KV_HEADS, HEAD_DIM, torch.float16, "cuda")
    positions = torch.randint(0, 4096, (64,), device="cuda")
    ref_q, ref_k = rope.forward_native(positions, q, k)
    out_q, out_k = apply_rotary(positions, q, k, rope.cos_sin_cache, HEAD_DIM, 64, True)
    assert rel_err(out_q, ref_q) < 2e-3 and rel_err(out_k, ref_k) < 2e-3


@pytest.mark.gpu
def test_gpu_each_layer_is_one_kernel():
    norm = make_norm(HIDDEN, torch.bfloat16, "cuda")
    rope = make_rope(HEAD_DIM, HEAD_DIM, 8192, True, "cuda", LLAMA3_SCALING)
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    gate_up = torch.randn(1, 2 * INTER, dtype=torch.bfloat16, device="cuda")
    _, q, k, _ = qkv_views(1, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    positions = torch.zeros(1, dtype=torch.long, device="cuda")
    residual = torch.randn_like(x)
    assert cuda_kernel_launches(lambda: norm(x, residual)) == 1
    assert cuda_kernel_launches(lambda: norm(x)) == 1
    assert cuda_kernel_launches(lambda: SiluAndMul()(gate_up)) == 1
    assert cuda_kernel_launches(lambda: rope(positions, q, k)) == 1


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_of_a_decode_step():
    torch.manual_seed(15)
    batch = 8
    norm = make_norm(HIDDEN, torch.bfloat16, "cuda")
    rope = make_rope(HEAD_DIM, HEAD_DIM, 8192, True, "cuda", LLAMA3_SCALING)
    act = SiluAndMul()
    hidden = torch.randn(batch, HIDDEN, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(hidden)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    gate_up = torch.randn(batch, 2 * INTER, dtype=torch.bfloat16, device="cuda")
    positions = torch.zeros(batch, dtype=torch.long, device="cuda")
    sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]

    def step():
        normed, summed = norm(hidden, residual)
        q, k, _ = qkv.split(sizes, dim=-1)
        q, k = rope(positions, q, k)
        return normed, summed, q, k, act(gate_up)

    def reference():
        q, k, _ = qkv.split(sizes, dim=-1)
        return (*norm.forward_native(hidden, residual), *rope.forward_native(positions, q, k),
                act.forward_native(gate_up))

    qkv_before = qkv.clone()
    step()  # compile outside capture
    qkv.copy_(qkv_before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for trial in range(2):
        for t in (hidden, residual, qkv, gate_up):
            t.normal_()
        positions.copy_(torch.randint(0, 8192, (batch,), device="cuda"))
        expected = reference()
        graph.replay()
        torch.cuda.synchronize()
        for out, ref in zip(outputs, expected):
            assert rel_err(out, ref) < 1e-2, trial


# ---------------------------------------------------------------------------------------------- KV store
def test_store_kv_writes_strided_rows_at_their_slots():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    T, hkv, d, dv, slots = 5, 2, 8, 4, 20
    qkv = torch.randn(T, 16 + hkv * d + hkv * dv, generator=gen).to(dev)
    k, v = qkv[:, 16:16 + hkv * d], qkv[:, 16 + hkv * d:]  # strided slices, as the model hands them over
    k_cache = torch.full((slots, hkv, d), float("nan"), device=dev)
    v_cache = torch.full((slots, hkv, dv), float("nan"), device=dev)
    loc = torch.tensor([7, 1, 19, 4, 12], device=dev)
    assert kv_store_kernels.store_kv(k_cache, v_cache, loc, k.view(T, hkv, d), v)
    assert torch.equal(k_cache[loc], k.reshape(T, hkv, d)) and torch.equal(v_cache[loc], v.reshape(T, hkv, dv))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert torch.isnan(k_cache[untouched.to(dev)]).all() and torch.isnan(v_cache[untouched.to(dev)]).all()
    # a dtype mismatch is declined (the pool then falls back to indexed assignment), nothing written
    assert not kv_store_kernels.store_kv(k_cache, v_cache, loc, k.half(), v)


@pytest.mark.parametrize("rotary_dim,neox", [(8, True), (4, True), (8, False)])
def test_rotary_and_store_kv_matches_rotary_then_store(rotary_dim, neox):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(rotary_dim)
    T, h, hkv, d, slots = 4, 4, 2, 8, 16
    qkv = torch.randn(T, (h + 2 * hkv) * d, generator=gen).to(dev)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    rope = make_rope(d, rotary_dim, 64, neox, device=dev)
    positions = torch.tensor([3, 0, 17, 63], device=dev)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    k_before = k.clone()
    k_cache = torch.full((slots, hkv, d), float("nan"), device=dev)
    v_cache = torch.full((slots, hkv, d), float("nan"), device=dev)
    loc = torch.tensor([9, 2, 15, 0], device=dev)
    assert rotary_kernels.apply_rotary_and_store_kv(positions, q, k, v, rope.cos_sin_cache, d, rotary_dim, neox,
                                                    k_cache, v_cache, loc)
    assert rel_err(q, want_q) < 1e-5  # q rotated in place
    assert torch.equal(k, k_before)  # k itself untouched; its rotation went to the cache
    assert rel_err(k_cache[loc].reshape(T, -1), want_k) < 1e-5
    assert torch.equal(v_cache[loc].reshape(T, -1), v)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert torch.isnan(k_cache[untouched.to(dev)]).all() and torch.isnan(v_cache[untouched.to(dev)]).all()
    # a cache of another dtype is declined, nothing written
    assert not rotary_kernels.apply_rotary_and_store_kv(positions, q, k, v, rope.cos_sin_cache, d, rotary_dim,
                                                        neox, k_cache.half(), v_cache.half(), loc)
