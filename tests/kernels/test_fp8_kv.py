"""FP8 KV caches through the attention backends: Triton (under TRITON_INTERPRET=1 on CPU) and torch decode alike
from the same fp8 pool, and both stay within fp8 rounding of attention over an fp32 pool holding the unrounded K/V.
e4m3 runs with per-layer scales chosen from the data (what a checkpoint's k_scale/v_scale provide)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from braid.runtime.core import ForwardBatch, ForwardMode
from braid.runtime.layers.attention.torch_backend import TorchAttnBackend
from braid.runtime.layers.attention.triton_backend import TritonAttnBackend
from braid.runtime.mem_cache.pools import MHAKVPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D = 4, 2, 32
PROMPT, LAYER = 24, 0


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _attend(backend_cls, kv_cache_dtype, scales, q, k, v):
    """Extend the first PROMPT tokens of one request, then decode one more: -> (extend out, decode out)."""
    k_scale, v_scale = scales
    pool = MHAKVPool(64, torch.float32, HKV, D, 1, DEVICE, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                     v_scale=v_scale)
    table = SimpleNamespace(req_to_token=torch.zeros(2, 64, dtype=torch.int32, device=DEVICE))
    runner = SimpleNamespace(device=DEVICE, tp_size=1, model_config=SimpleNamespace(
        num_attention_heads=H, num_key_value_heads=HKV, head_dim=D, v_head_dim=D))
    backend = backend_cls(runner) if backend_cls is TritonAttnBackend else backend_cls()
    layer = SimpleNamespace(layer_id=LAYER, num_heads=H, num_kv_heads=HKV, head_dim=D, v_head_dim=D,
                            scaling=D ** -0.5, logit_cap=0.0, sliding_window=-1)
    slots = torch.arange(1, PROMPT + 2, device=DEVICE)
    table.req_to_token[0, :PROMPT + 1] = slots.int()
    i32 = lambda *xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    common = dict(req_pool_indices=torch.zeros(1, dtype=torch.long, device=DEVICE), req_to_token_pool=table,
                  kv_pool=pool, attn_backend=backend)
    extend = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1,
                          input_ids=torch.zeros(PROMPT, dtype=torch.long, device=DEVICE),
                          positions=torch.arange(PROMPT, device=DEVICE), seq_lens=i32(PROMPT),
                          out_cache_loc=slots[:PROMPT], seq_lens_cpu=[PROMPT], extend_prefix_lens=i32(0),
                          extend_seq_lens=i32(PROMPT), extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[PROMPT],
                          extend_start_loc=i32(0), **common)
    backend.init_forward_metadata(extend)
    flat = lambda t: t.reshape(t.shape[0], -1)  # noqa: E731
    out_extend = backend.forward(flat(q[:PROMPT]), flat(k[:PROMPT]), flat(v[:PROMPT]), layer, extend)
    decode = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1,
                          input_ids=torch.zeros(1, dtype=torch.long, device=DEVICE),
                          positions=torch.tensor([PROMPT], device=DEVICE), seq_lens=i32(PROMPT + 1),
                          out_cache_loc=slots[PROMPT:], seq_lens_cpu=[PROMPT + 1], **common)
    backend.init_forward_metadata(decode)
    out_decode = backend.forward(flat(q[PROMPT:]), flat(k[PROMPT:]), flat(v[PROMPT:]), layer, decode)
    return out_extend, out_decode


@pytest.mark.parametrize("kv_cache_dtype,bound", [("fp8_e5m2", 0.12), ("fp8_e4m3", 0.08)])
def test_fp8_kv_attention_is_close_to_fp32_kv(kv_cache_dtype, bound):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(PROMPT + 1, H, D, generator=gen).to(DEVICE)
    k = (torch.randn(PROMPT + 1, HKV, D, generator=gen) * 2.0).to(DEVICE)
    v = (torch.randn(PROMPT + 1, HKV, D, generator=gen) * 0.1).to(DEVICE)
    # e4m3: scales that put each tensor's largest value at 448 (e5m2 stores values as they are)
    scales = (float(k.abs().max() / 448), float(v.abs().max() / 448)) if kv_cache_dtype == "fp8_e4m3" else (1.0, 1.0)
    exact = _attend(TorchAttnBackend, None, (1.0, 1.0), q, k, v)
    torch_fp8 = _attend(TorchAttnBackend, kv_cache_dtype, scales, q, k, v)
    triton_fp8 = _attend(TritonAttnBackend, kv_cache_dtype, scales, q, k, v)
    for got in (torch_fp8, triton_fp8):
        for out, ref in zip(got, exact):
            assert rel_err(out, ref) < bound, (kv_cache_dtype, rel_err(out, ref))
    # decode: both backends read the same fp8 values from the pool
    assert 0 < rel_err(torch_fp8[1], exact[1]) and rel_err(triton_fp8[1], torch_fp8[1]) < 1e-4
    # extend: torch reads the chunk's own K/V back from the pool (rounded); Triton's extend kernel takes them from
    # the projections (as SGLang's does) and rounds only the cached prefix, none here
    assert rel_err(triton_fp8[0], exact[0]) < 1e-4 < rel_err(torch_fp8[0], exact[0])
