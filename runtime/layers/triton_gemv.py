"""Triton GEMV for decode at batch 1: y[1, N] = x[1, K] @ W[N, K]^T, reading each weight once.

At batch 1 a decode step is a stream over the weights; this kernel gives every program BLOCK_N whole rows
of W (coalesced along K), keeps BLOCK_N x BLOCK_K partial products in registers and reduces once at the end.
Configs are autotuned per (N, K) on first use, which happens in the warm-up passes before CUDA-graph capture.
Runs on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["gemv", "supports"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=1)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w in ((8, 512, 4), (16, 512, 4), (16, 256, 4), (32, 256, 8), (8, 1024, 8), (16, 1024, 8))
            for st in (2, 4)]


@triton.autotune(configs=_configs(), key=["N", "K"])
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, w_row_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_row_stride
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        k_mask = kk < K
        x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when gemv(x, weight) applies: one row of x, a 2-D weight with unit stride along K, same dtype."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.dtype == weight.dtype and weight.stride(1) == 1 and x.device == weight.device)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [1, K], weight: [N, K] -> [1, N] in x's dtype (fp32 accumulation)."""
    if not supports(x, weight):
        raise ValueError(f"gemv needs x [1, K] and weight [N, K] of one dtype and device, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, weight, y, n, k, weight.stride(0))
    return y
