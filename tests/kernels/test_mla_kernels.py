"""MLAKVPool.store_latent_and_build_query: the one-launch Triton path (mla_kernels) against the unfused one (the
q_nope x w_kc bmm, RMSNorm, rotary, set_kv, concatenation): the same query rows, the same cache rows, untouched
slots left alone.

Without a GPU the kernel runs under TRITON_INTERPRET=1 on CPU tensors (conftest.py); the pool only launches Triton
kernels on CUDA, so on CPU the test lets it (`_triton_kernels_run_on`).
"""

from __future__ import annotations

import pytest
import torch

from braid.runtime.layers import mla_kernels
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.rotary import RotaryEmbedding
from braid.runtime.mem_cache import pools
from braid.runtime.mem_cache.pools import MLAKVPool
from kv_pools import fallback_pool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# R = 80 is not a power of two and spans two latent blocks of 64; nope 24 pads to a 32-wide dot
H, R, P, NOPE, SLOTS = 5, 80, 8, 24, 40
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


@pytest.mark.parametrize("dtype,neox,tokens", [(torch.float32, False, 4), (torch.bfloat16, True, 4),
                                               (torch.bfloat16, False, 19)],
                         ids=["fp32_interleaved", "bf16_neox", "bf16_two_token_blocks"])
def test_fused_decode_store_matches_unfused(monkeypatch, dtype, neox, tokens):
    monkeypatch.setattr(pools, "_triton_kernels_run_on", lambda device: True)
    calls = []
    real = mla_kernels.mla_decode_prepare
    monkeypatch.setattr(mla_kernels, "mla_decode_prepare", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rotary = RotaryEmbedding(P, P, 64, 10000.0, YARN, is_neox_style=neox)
    rotary.build_cache(DEVICE)
    norm = RMSNorm(R, 1e-6)
    norm.weight.data = torch.rand(R, generator=g, device=DEVICE) + 0.5
    # rows of a projection output: latent and k_pe are strided slices, q_pe a strided view of q
    T = tokens
    proj = torch.randn(T, 3 + R + P, device=DEVICE, generator=g).to(dtype)
    latent, k_pe = proj[:, 3:3 + R], proj[:, 3 + R:]
    q = torch.randn(T, H, NOPE + P, device=DEVICE, generator=g).to(dtype)
    q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
    w_kc = (torch.randn(H, NOPE, R, device=DEVICE, generator=g) / NOPE ** 0.5).to(dtype)
    positions = torch.randint(0, 64, (T,), device=DEVICE, generator=g)
    loc = torch.randperm(SLOTS, device=DEVICE, generator=g)[:T] + 1
    outs = {}
    for fused in (True, False):
        def make():
            return MLAKVPool(SLOTS, dtype, R, P, layer_num=2, device=DEVICE)
        pool = make() if fused else fallback_pool(make)
        q_full = pool.store_latent_and_build_query(1, loc, positions, latent.clone(), k_pe.clone(), norm, rotary,
                                                   q_nope, w_kc, q_pe.clone())
        outs[fused] = (q_full, pool.get_key_buffer(1).clone(), pool.get_key_buffer(0).clone())
    assert calls == [1]
    (q_f, kv_f, other_f), (q_u, kv_u, _) = outs[True], outs[False]
    assert q_f.shape == (T, H, R + P) and q_f.dtype == dtype
    # the latent query against an fp32 matmul (the unfused bmm rounds like the fused dot, up to summation order)
    q_latent = torch.einsum("thn,hnr->thr", q_nope.float(), w_kc.float())
    torch.testing.assert_close(q_f[..., :R].float(), q_latent, atol=1e-5 if dtype == torch.float32 else 3e-2,
                               rtol=1e-5 if dtype == torch.float32 else 2 ** -7)
    # fp32 math in both, rounded once; bf16 results may differ in the last bit (fused multiply-adds)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(q_f, q_u, **tol)
    torch.testing.assert_close(kv_f, kv_u, **tol)
    untouched = torch.ones(SLOTS + 1, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not kv_f[untouched.to(DEVICE)].any() and not other_f.any()
    assert kv_f[loc].abs().sum(-1).min() > 0


def test_fp8_cache_takes_the_unfused_path(monkeypatch):
    monkeypatch.setattr(pools, "_triton_kernels_run_on", lambda device: True)
    pool = MLAKVPool(SLOTS, torch.bfloat16, R, P, layer_num=1, device=DEVICE, kv_cache_dtype="fp8_e5m2")
    assert not pool._decode_store_in_one_launch
    assert MLAKVPool(SLOTS, torch.bfloat16, R, P, layer_num=1, device=DEVICE)._decode_store_in_one_launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_values_gemv_matches_the_batched_matmul(dtype):
    """The decode path's w_vc GEMV (attention output over the latent -> each head's value channels, [T, H * V])
    == the batched matmul it replaces; R 80 and V 18 are not multiples of the blocks."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    attn = torch.randn(3, H, R + 7, device=DEVICE, generator=g).to(dtype)[..., :R]  # strided rows, as a view
    w_vc = (torch.randn(H, 18, R, device=DEVICE, generator=g) / R ** 0.5).to(dtype)
    out = mla_kernels.latent_values_gemv(attn, w_vc)
    want = torch.einsum("thr,hvr->thv", attn.float(), w_vc.float()).reshape(3, H * 18)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
    assert out.shape == (3, H * 18) and out.dtype == dtype
    torch.testing.assert_close(out.float(), want, **tol)
    torch.testing.assert_close(mla_kernels.latent_to_head_values(attn, w_vc).float(), want, **tol)


def _e4m3_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, rows, R] -> (e4m3, fp32 scales [H, rows]), one scale per row."""
    scale = w.float().abs().amax(-1).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (w.float() / scale[..., None]).to(torch.float8_e4m3fn), scale.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_w_kc_and_w_vc_equal_their_dequantized_copies(monkeypatch, dtype):
    """FP8 checkpoints keep w_kc / w_vc in e4m3 with row scales: the fused decode kernel and the value GEMV compute
    what the dequantized weights give (the batched-matmul paths), up to rounding the scaled tile to the dtype."""
    monkeypatch.setattr(pools, "_triton_kernels_run_on", lambda device: True)
    g = torch.Generator(device=DEVICE).manual_seed(2)
    rotary = RotaryEmbedding(P, P, 64, 10000.0, None, is_neox_style=False)
    rotary.build_cache(DEVICE)
    norm = RMSNorm(R, 1e-6)
    T = 5
    latent = torch.randn(T, R, device=DEVICE, generator=g).to(dtype)
    k_pe = torch.randn(T, P, device=DEVICE, generator=g).to(dtype)
    q_nope = torch.randn(T, H, NOPE, device=DEVICE, generator=g).to(dtype)
    q_pe = torch.randn(T, H, P, device=DEVICE, generator=g).to(dtype)
    w_kc, kc_scale = _e4m3_rows(torch.randn(H, NOPE, R, device=DEVICE, generator=g) * 0.2)
    positions = torch.arange(T, device=DEVICE)
    loc = torch.arange(1, T + 1, device=DEVICE)
    dense = mla_kernels.dequantized_head_weight(w_kc, kc_scale, dtype)

    def make():
        return MLAKVPool(SLOTS, dtype, R, P, layer_num=1, device=DEVICE)
    got, want = (pool.store_latent_and_build_query(0, loc, positions, latent, k_pe, norm, rotary, q_nope, w, q_pe, s)
                 for pool, w, s in ((make(), w_kc, kc_scale), (fallback_pool(make), dense, None)))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2 ** -7)
    torch.testing.assert_close(got, want, **tol)

    attn = torch.randn(3, H, R, device=DEVICE, generator=g).to(dtype)
    w_vc, vc_scale = _e4m3_rows(torch.randn(H, 18, R, device=DEVICE, generator=g) * 0.1)
    want = torch.einsum("thr,hvr->thv", attn.float(), w_vc.float() * vc_scale[..., None]).reshape(3, H * 18)
    torch.testing.assert_close(mla_kernels.latent_values_gemv(attn, w_vc, vc_scale).float(), want, **tol)
    torch.testing.assert_close(mla_kernels.latent_to_head_values(attn, w_vc, vc_scale).float(), want, **tol)
    with pytest.raises(mla_kernels.FusedKernelInputError, match="e4m3"):
        mla_kernels.latent_values_gemv(attn, w_vc, vc_scale.double())
