"""Decode attention over fp8 KV caches upcasts V tiles before their shared-memory staging (STAGE_V).

Compiled for sm90 (offline, with Triton's bundled ptxas: no GPU needed), stage 1 with fp8 V read the staged tile a
byte per shared-memory load (LDS.U8); with STAGE_V it reads 16-bit tiles through ldmatrix as for bf16 caches. On a
GPU both launches give the same output (within 1e-5) and match attention over the dequantized cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from braid.runtime.layers.attention.triton_ops import decode_attention_fwd

# Compiled in a subprocess: under TRITON_INTERPRET=1 (the test run's setting) kernels are interpreted, not compiled.
# With benchmarks/decode_attention_occupancy.py's offline compile. Shapes: Llama-3-8B heads (the launch for head_dim
# 128, and with ROWS_AHEAD as the runtime launches it over fp8) and DeepSeek-V2's latent (576 = 512 + 64 keys, 512
# values, one buffer). Prints the number of LDS.U8 instructions of stage 1 compiled for sm90.
BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks")
COUNT_SHARED_BYTE_LOADS = """
import re, sys
import triton.language as tl
from decode_attention_occupancy import run_on_cubin, stage1_for_sm90

kv_type, shape, stage_v = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
gqa_128 = dict(KV_GROUP=4, D=128, DV=128, BLOCK_D=128, BLOCK_DPE=0, BLOCK_DV=128, BLOCK_N=64)
shape_constants, num_warps, num_stages = {
    "gqa-128": (gqa_128, 2, 2),
    "gqa-128-rows-ahead": (dict(gqa_128, ROWS_AHEAD=True), 2, 3),  # the runtime's launch for fp8 caches
    "mla-576": (dict(KV_GROUP=16, D=576, DV=512, BLOCK_D=512, BLOCK_DPE=64, BLOCK_DV=512, BLOCK_N=32), 8, 2),
}[shape]
constants = dict(shape_constants, DOT_DTYPE=tl.float16, CLAMP_Q=True, STAGE_V=stage_v, USE_PDL=False)
sass = run_on_cubin(stage1_for_sm90(constants, kv_type, num_warps, num_stages), "nvdisasm", "-c")
assert "HMMA" in sass, "not the kernel's disassembly: no tensor-core dot"
print(len(re.findall(r"\\bLDS\\.U8\\b", sass)))
"""


def shared_byte_loads(kv_type: str, shape: str, stage_v: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [BENCHMARKS, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", COUNT_SHARED_BYTE_LOADS, kv_type, shape, str(int(stage_v))],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.parametrize("shape", ["gqa-128", "gqa-128-rows-ahead", "mla-576"])
def test_fp8_values_leave_shared_memory_in_16_bit_loads(shape):
    assert shared_byte_loads("fp8e4nv", shape, stage_v=False) >= 64
    assert shared_byte_loads("fp8e4nv", shape, stage_v=True) == 0
    assert shared_byte_loads("fp8e5", shape, stage_v=True) == 0


def _decode(q, k_cache, v_cache, scale, splits, stage_v):
    b, h, _ = q.shape
    seq_len = k_cache.shape[0] // b
    o = torch.empty(b, h, v_cache.shape[-1], device=q.device, dtype=q.dtype)
    scratch = torch.empty(b, h, splits, v_cache.shape[-1] + 1, device=q.device, dtype=torch.float32)
    req_to_token = torch.arange(b * seq_len, device=q.device, dtype=torch.int32).view(b, seq_len)
    seq_lens = torch.full((b,), seq_len, device=q.device, dtype=torch.int32)
    decode_attention_fwd(q, k_cache, v_cache, o, req_to_token, torch.arange(b, device=q.device), seq_lens, scratch,
                         splits, q.shape[-1] ** -0.5, k_scale=scale, v_scale=scale,
                         launch_config={"STAGE_V": stage_v})
    return o


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gpu_staged_fp8_values_give_the_same_attention(fp8):
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, h_kv, d, seq_len, scale = 3, 32, 8, 128, 700, 0.25
    q = torch.randn(b, h, d, device="cuda", generator=gen).bfloat16()
    k_cache = (torch.randn(b * seq_len, h_kv, d, device="cuda", generator=gen) / scale).to(fp8)
    v_cache = (torch.randn(b * seq_len, h_kv, d, device="cuda", generator=gen) / scale).to(fp8)
    staged = _decode(q, k_cache, v_cache, scale, 8, stage_v=True)
    unstaged = _decode(q, k_cache, v_cache, scale, 8, stage_v=False)
    # the same fp16 operands reach the dots; only where the upcast happens differs (and with it, on an H100, the
    # order of some e4m3 products within a dot: 4.8e-7 apart at most, against 5e-4 of either from the reference)
    assert (staged.float() - unstaged.float()).abs().max().item() <= 1e-5
    k = (k_cache.float() * scale).view(b, seq_len, h_kv, d).repeat_interleave(h // h_kv, dim=2)
    v = (v_cache.float() * scale).view(b, seq_len, h_kv, d).repeat_interleave(h // h_kv, dim=2)
    probs = torch.softmax(torch.einsum("bhd,bshd->bhs", q.float(), k) * d ** -0.5, dim=-1)
    reference = torch.einsum("bhs,bshd->bhd", probs, v)
    assert (staged.float() - reference).abs().max().item() < 2e-2
