"""Gemma-2's fused decode kernels against the unfused layers and HF's modules: the sandwich-norm kernel (post-norm,
residual add, next pre-norm in one launch; gemma_kernels.py) and the batch-1 GEMV with GELU-tanh-and-mul fused after
it (gemv.py). On a GPU when there is one, else under TRITON_INTERPRET=1 on CPU tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from braid.runtime.layers.activation import GeluAndMul
from braid.runtime.layers.gemma_kernels import ONE_TILE_MAX, fused_post_norm_add_norm, post_norm_add_norm
from braid.runtime.layers.gemv import gemv
from braid.runtime.layers.kernel_inputs import FusedKernelInputError
from braid.runtime.layers.norm import RMSNorm

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def rel_err(out, ref):
    assert torch.isfinite(out.float()).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _norm(n, eps, dtype, gen):
    norm = RMSNorm(n, eps, add_unit_offset=True)
    norm.weight = torch.nn.Parameter(torch.randn(n, generator=gen).to(device=DEVICE, dtype=dtype) * 0.5,
                                     requires_grad=False)
    return norm


def _hf_chain(x, residual, post, nxt):
    """HF Gemma2DecoderLayer's order: post_norm(x), `residual + hidden`, then the next norm."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    def hf(norm):
        m = Gemma2RMSNorm(norm.weight.shape[0], eps=norm.eps).to(device=x.device, dtype=x.dtype)
        m.weight.data.copy_(norm.weight)
        return m

    stream = residual + hf(post)(x)
    return hf(nxt)(stream), stream


@pytest.mark.parametrize("rows,n", [(1, 64), (3, 200), (5, 3584)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sandwich_norm_kernel_matches_hf_layers(rows, n, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(device=DEVICE, dtype=dtype)
    residual = (torch.randn(rows, n, generator=gen) * 10).to(device=DEVICE, dtype=dtype)
    post, nxt = _norm(n, 1e-6, dtype, gen), _norm(n, 1e-5, dtype, gen)
    out, stream = fused_post_norm_add_norm(x, residual, post.weight, nxt.weight, post.eps, nxt.eps)
    want_out, want_stream = _hf_chain(x, residual, post, nxt)
    assert out.dtype == stream.dtype == dtype and out.shape == stream.shape == x.shape
    # bf16 rounds at the same points; the interpreter truncates where the GPU rounds to nearest
    tol = 1e-5 if dtype == torch.float32 else 5e-3 if HAS_CUDA else 2e-2
    assert rel_err(stream, want_stream) < tol and rel_err(out, want_out) < tol
    # the module-level entry point: the kernel on CUDA, the modules' own PyTorch path elsewhere
    got_out, got_stream = post_norm_add_norm(x, residual, post, nxt)
    ref_out, ref_stream = nxt.forward_native(post.forward_native(x), residual)
    assert rel_err(got_stream, ref_stream) < tol and rel_err(got_out, ref_out) < tol


def test_sandwich_norm_wide_rows_take_two_kernels():
    gen = torch.Generator().manual_seed(3)
    n = ONE_TILE_MAX + 16
    x, residual = torch.randn(2, n, generator=gen).to(DEVICE), torch.randn(2, n, generator=gen).to(DEVICE)
    post, nxt = _norm(n, 1e-6, torch.float32, gen), _norm(n, 1e-6, torch.float32, gen)
    out, stream = fused_post_norm_add_norm(x, residual, post.weight, nxt.weight, post.eps, nxt.eps)
    want_out, want_stream = _hf_chain(x, residual, post, nxt)
    assert (stream - want_stream).abs().max() < 1e-5 and (out - want_out).abs().max() < 1e-5


def test_sandwich_norm_kernel_rejects_mismatched_inputs():
    x = torch.randn(2, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    with pytest.raises(FusedKernelInputError, match="hidden size"):
        fused_post_norm_add_norm(x, x.clone(), w, torch.ones(31, device=DEVICE), 1e-6, 1e-6)
    with pytest.raises(FusedKernelInputError, match="residual"):
        fused_post_norm_add_norm(x, torch.randn(2, 32, device=DEVICE, dtype=torch.float64), w, w, 1e-6, 1e-6)


@pytest.mark.parametrize("n,k", [(48, 64), (37, 200), (16, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_gelu_tanh_mul_matches_unfused_layers(n, k, dtype):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=gen).to(device=DEVICE, dtype=dtype)
    w = (torch.randn(2 * n, k, generator=gen) * 2 / k ** 0.5).to(device=DEVICE, dtype=dtype)
    got = gemv(x, w, gelu_tanh_mul=True)
    # the unfused path: matmul rounded to the dtype, then GeluAndMul's PyTorch reference (activation rounded)
    want = GeluAndMul("tanh").forward_native(F.linear(x.double(), w.double()).to(dtype))
    assert got.shape == (1, n) and got.dtype == dtype and torch.isfinite(got.float()).all()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2 if HAS_CUDA else 4e-2)
    assert rel_err(gemv(x, w, silu_mul=True), want) > 0.05  # the other activation really is another result


def test_gemv_takes_one_gated_activation():
    x, w = torch.randn(1, 8, device=DEVICE), torch.randn(6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one gated activation"):
        gemv(x, w, silu_mul=True, gelu_tanh_mul=True)
    with pytest.raises(ValueError, match="2N"):
        gemv(x, torch.randn(5, 8, device=DEVICE), gelu_tanh_mul=True)


@pytest.mark.parametrize("window", [-1, 40])
def test_decode_attention_merges_many_splits(window):
    """Gemma-2's decode shape (head_dim 256, a soft-cap, 2 query heads per KV head) split 40 ways: stage 2 merges the
    splits 16 at a time (3 chunks, the last partial), equal to plain softmax attention over the visible keys."""
    from braid.runtime.layers.attention.triton_ops import decode_attention_fwd

    gen = torch.Generator().manual_seed(21)
    h, h_kv, d, cap, scale, splits = 4, 2, 256, 5.0, 0.0625, 40
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32  # (fp32 dots at head_dim 256 compile for minutes)
    seq_lens = [700, 23, 1]
    slots = torch.randperm(sum(seq_lens), generator=gen) + 1
    req_to_token = torch.zeros((len(seq_lens), max(seq_lens)), dtype=torch.int32)
    off = 0
    for b, n in enumerate(seq_lens):
        req_to_token[b, :n] = slots[off:off + n].int()
        off += n
    k_buf = torch.randn(sum(seq_lens) + 1, h_kv, d, generator=gen)
    v_buf = torch.randn(sum(seq_lens) + 1, h_kv, d, generator=gen)
    q = torch.randn(len(seq_lens), h, d, generator=gen)
    o = torch.full_like(q, float("nan"))
    scratch = torch.empty(len(seq_lens), h, splits, d + 1)
    q, k_buf, v_buf, o = (t.to(device=DEVICE, dtype=dtype) for t in (q, k_buf, v_buf, o))
    req_to_token, scratch = req_to_token.to(DEVICE), scratch.to(DEVICE)
    decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, torch.arange(len(seq_lens), device=DEVICE),
                         torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), scratch, splits, scale, cap, window)
    for b, n in enumerate(seq_lens):
        first = max(0, n - window) if window > 0 else 0
        rows = req_to_token[b, first:n].long()
        keys = k_buf[rows].float().repeat_interleave(h // h_kv, 1)  # [L, H, D]
        s = torch.einsum("hd,lhd->hl", q[b].float(), keys) * scale
        p = torch.softmax(cap * torch.tanh(s / cap), -1)
        want = torch.einsum("hl,lhd->hd", p, v_buf[rows].float().repeat_interleave(h // h_kv, 1))
        assert (o[b].float() - want).abs().max() < (1e-4 if dtype == torch.float32 else 3e-2), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_fp32_is_lm_heads_cap(dtype):
    from braid.runtime.layers.gemma_kernels import SOFTCAP_BLOCK, soft_capped_fp32

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, SOFTCAP_BLOCK + 77, generator=gen) * 40).to(device=DEVICE, dtype=dtype)
    got = soft_capped_fp32(logits, 30.0)
    want = torch.tanh(logits.float() / 30.0) * 30.0
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert (got - want).abs().max() < 1e-4 and got.abs().max() <= 30.0 and want.abs().max() > 29.0
    with pytest.raises(FusedKernelInputError, match="soft-cap"):
        soft_capped_fp32(logits, 0.0)


def test_triton_backend_splits_small_decode_batches_further():
    """Gemma-2-9B's heads (16 query, 8 KV) on a 132-SM GPU: 48 splits at batch 1, 24 at 2, the default 16 from 3 on;
    a split count given explicitly holds for every batch; the CUDA-graph scratch of each batch size is a view at the
    start of one buffer, [bs, H, splits(bs), Dv + 1]."""
    from types import SimpleNamespace

    from braid.runtime.layers.attention.triton_backend import TritonAttnBackend

    config = SimpleNamespace(num_attention_heads=16, num_key_value_heads=8, head_dim=256)
    backend = TritonAttnBackend(SimpleNamespace(device="cpu", model_config=config))
    assert [backend.decode_kv_splits(bs) for bs in (1, 2, 3, 8)] == [4, 4, 4, 4]  # CPU: the interpreter's count
    backend.sm_count, backend.num_kv_splits = 132, 16  # as on an H200
    assert [backend.decode_kv_splits(bs) for bs in (1, 2, 3, 8, 64)] == [32, 16, 16, 16, 16]
    backend.init_cuda_graph_state(8)
    views = {bs: backend._graph_scratch_view(bs) for bs in (1, 2, 8)}
    assert views[1].shape == (1, 16, 32, 257) and views[2].shape == (2, 16, 16, 257) and views[8].shape[2] == 16
    assert len({v.data_ptr() for v in views.values()} | {backend.cuda_graph_attn_logits.data_ptr()}) == 1
    fixed = TritonAttnBackend(SimpleNamespace(device="cpu", model_config=config), num_kv_splits=16)
    fixed.sm_count = 132
    assert fixed.decode_kv_splits(1) == 16


def test_split_count_given_as_a_server_arg_is_used_for_every_batch():
    from types import SimpleNamespace

    from braid.runtime.config import ServerArgs
    from braid.runtime.layers.attention.triton_backend import TritonAttnBackend

    with pytest.raises(ValueError, match="triton_attention_num_kv_splits"):
        ServerArgs(model_path="smollm2", triton_attention_num_kv_splits=0)
    args = ServerArgs(model_path="smollm2", triton_attention_num_kv_splits=24)
    config = SimpleNamespace(num_attention_heads=16, num_key_value_heads=8, head_dim=256)
    backend = TritonAttnBackend(SimpleNamespace(device="cpu", model_config=config, server_args=args))
    backend.sm_count = 132
    assert [backend.decode_kv_splits(bs) for bs in (1, 2, 64)] == [24, 24, 24]
