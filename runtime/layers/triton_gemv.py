"""Triton GEMV for decode at batch 1, with the RMSNorm before it and SiLU-and-mul after it fused in.

At batch 1 a decode step is a stream over the weights, and around each weight GEMM sit small kernels (the
residual add + RMSNorm before qkv_proj and gate_up_proj, SiLU-and-mul after gate_up_proj) whose launches cost
as much as a few microseconds of weight streaming each. One kernel here does

    y[1, N] = act(norm(x [+ residual]) @ W[N(, +N), K]^T)

Every program owns BLOCK_N rows of W (coalesced along K) and keeps BLOCK_N x BLOCK_K partial products in
registers. With the norm fused, every program first reduces x's sum of squares itself (K values from L2; far
cheaper than a launch) and program 0 writes the residual sum. With SiLU-and-mul fused, a program owns the
gate rows n and the up rows n + N of a [2N, K] weight and writes silu(gate) * up. Values are rounded to the
activation dtype where the unfused path (norm.py, activation.py) rounds them.

With programmatic dependent launch (PDL, Hopper and later; see pdl.py), a GEMV is launched while the
kernel before it drains: every program loads its first weight chunk, which no earlier kernel writes, then
waits (griddepcontrol.wait) for the previous kernel's results before touching x. The weight stream thus
starts during the previous kernel's tail instead of after its completion and this launch's latency. Each
GEMV also signals its dependents as soon as it starts, so the GEMV after it can do the same.

Configs are autotuned per shape on first use, which the CUDA-graph runner's warm-up passes do before capture.
Runs on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel

__all__ = ["gemv", "supports", "decode_gemv_applies", "ENABLED", "FUSE_NORM"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# batch-1 bf16/fp16 matmuls on CUDA go through this kernel; switches for A/B timing. FUSE_NORM: the RMSNorm
# before a projection runs inside the GEMV (every program then re-reads x and the residual from L2)
ENABLED = True
FUSE_NORM = os.environ.get("BRAID_GEMV_FUSE_NORM", "0") == "1"
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=1)]
    # the best of a 44-config sweep per Llama-3-8B shape on an H200 (benchmarks/gpu/decode_b1.py), and neighbours
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((4, 2048, 4, 1), (4, 2048, 4, 3), (2, 1024, 4, 3), (4, 1024, 4, 3),
                                  (2, 2048, 4, 3), (8, 1024, 4, 1))]


@triton.jit
def _activation_chunk(x_ptr, res_ptr, norm_w_ptr, kk, k_mask, rstd,
                      NORM: tl.constexpr, HAS_RES: tl.constexpr, UNIT_OFFSET: tl.constexpr, EVEN_K: tl.constexpr):
    """x[kk] as the GEMV consumes it (fp32): normed (x + residual) rounded to x's dtype, or x itself."""
    if EVEN_K:
        x = tl.load(x_ptr + kk).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    if NORM:
        if HAS_RES:
            if EVEN_K:
                r = tl.load(res_ptr + kk).to(tl.float32)
            else:
                r = tl.load(res_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            x = (x + r).to(x_ptr.dtype.element_ty).to(tl.float32)
        if EVEN_K:
            nw = tl.load(norm_w_ptr + kk).to(tl.float32)
        else:
            nw = tl.load(norm_w_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            nw = nw + 1.0
        x = (x * rstd * nw).to(x_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, y_ptr, N, K, w_row_stride, eps,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr, UNIT_OFFSET: tl.constexpr, SILU_MUL: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    let_next_kernel_launch(USE_PDL)
    cols = tl.arange(0, BLOCK_K)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_row_stride
    up_rows = w_rows + N.to(tl.int64) * w_row_stride  # SILU_MUL: the up half starts N rows further
    # the first weight chunk: no earlier kernel writes W, so it streams before the wait for x
    if EVEN_K:
        w_mask0 = row_mask[:, None]
    else:
        w_mask0 = row_mask[:, None] & (cols < K)[None, :]
    w0 = tl.load(w_rows + cols[None, :], mask=w_mask0, other=0.0, eviction_policy="evict_first")
    u0 = w0
    if SILU_MUL:
        u0 = tl.load(up_rows + cols[None, :], mask=w_mask0, other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(USE_PDL)
    rstd = 1.0
    if NORM:
        sum_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + cols
            k_mask = kk < K
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(res_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
                s = (x + r).to(x_ptr.dtype.element_ty)
                tl.store(res_out_ptr + kk, s, mask=k_mask & (cols * 0 + pid == 0))
                x = s.to(tl.float32)
            sum_sq += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / K + eps)

    x0 = _activation_chunk(x_ptr, res_ptr, norm_w_ptr, cols, cols < K, rstd, NORM, HAS_RES, UNIT_OFFSET, EVEN_K)
    acc = w0.to(tl.float32) * x0[None, :]
    acc_up = u0.to(tl.float32) * x0[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + cols
        k_mask = kk < K
        x = _activation_chunk(x_ptr, res_ptr, norm_w_ptr, kk, k_mask, rstd, NORM, HAS_RES, UNIT_OFFSET, EVEN_K)
        if EVEN_K:
            w_mask = row_mask[:, None]
        else:
            w_mask = row_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        if SILU_MUL:
            u = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc_up += u.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if SILU_MUL:
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(y_ptr.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


_gemv_autotuned = triton.autotune(configs=_configs(), key=["N", "K", "NORM", "SILU_MUL", "USE_PDL"])(_gemv_kernel)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when gemv(x, weight) applies: one row of x, a 2-D weight with unit stride along K, same dtype."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.dtype == weight.dtype and weight.stride(1) == 1 and x.device == weight.device)


def decode_gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether the runtime routes this matmul here: batch-1 bf16/fp16 on CUDA without a bias."""
    return ENABLED and bias is None and x.is_cuda and x.dtype in _HALF_DTYPES and supports(x, weight)


def gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None,
         residual: Optional[torch.Tensor] = None, eps: float = 1e-6, unit_offset: bool = False,
         silu_mul: bool = False, config: Optional[dict] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x: [1, K]; weight: [N, K] (or [2N, K] = [gate; up] with silu_mul) -> (y [1, N], residual_out).

    With norm_weight: y = norm(x + residual) @ W^T and residual_out = x + residual (x itself without a
    residual), as RMSNorm.forward returns them. With silu_mul: y = silu(x @ Wg^T) * (x @ Wu^T).
    residual_out is None without norm_weight. `config` (BLOCK_N, BLOCK_K, num_warps, num_stages) skips
    the autotuner (benchmarks sweep configs with it)."""
    if not supports(x, weight):
        raise ValueError(f"gemv needs x [1, K] and weight [N, K] of one dtype and device, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    rows, k = weight.shape
    if silu_mul and rows % 2:
        raise ValueError(f"silu_mul needs a [2N, K] weight, got {rows} rows")
    n = rows // 2 if silu_mul else rows
    norm = norm_weight is not None
    if norm and (norm_weight.shape != (k,) or norm_weight.device != x.device):
        raise ValueError(f"norm_weight must be [{k}] on {x.device}, got {tuple(norm_weight.shape)}")
    has_res = norm and residual is not None
    if has_res and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    x = x.contiguous()
    res = residual.contiguous() if has_res else x
    res_out = torch.empty_like(x) if has_res else x
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    args = (x, res, res_out, norm_weight if norm else x, weight, y, n, k, weight.stride(0), float(eps))
    flags = dict(NORM=norm, HAS_RES=has_res, UNIT_OFFSET=bool(unit_offset), SILU_MUL=bool(silu_mul),
                 **pdl.launch_options(x.device))
    if config is None:
        even_k = k % 2048 == 0 if not _INTERPRET else k % 64 == 0
        _gemv_autotuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags, EVEN_K=even_k)
    else:
        cfg = dict(config)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](*args, **flags, EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg,
                                                        **launch)
    if not norm:
        return y, None
    return y, (res_out if has_res else x)
