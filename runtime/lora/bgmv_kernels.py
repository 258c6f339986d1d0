"""Per-row (BGMV-shaped) LoRA kernels for decode-sized batches: every row gathers its own adapter's A and B, so a
batch whose rows sit on many adapters costs no more passes than one whose rows share one (the SGMV kernels of
sgmv_kernels.py loop over the adapters present in each row block, which dominates at a few rows on many adapters).

  shrink: h[P, T, RT] fp32 partial sums, h[:, t] summed = A[idx[t]] @ x[t] (zeros where idx[t] < 0);
          grid (T, RT blocks, P splits of K)
  expand: y[t, cols] += scale[idx[t]] * B_s[idx[t]][cols - off_s] @ h[t, s*R : (s+1)*R] for the slice s of each
          column; grid (T, column blocks); rows with idx < 0 untouched

The partials have sgmv_shrink's layout, so either expand takes either shrink's output. Both launch with PDL where
the device has it (layers/pdl.py), as the batch-1 GEMVs around them do: each lets the next kernel launch and then
waits for the previous one at its very start, so a decode step's chain of small kernels stays overlapped through the
delta ops. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from braid.runtime.layers import pdl
from braid.runtime.layers.pdl import let_next_kernel_launch, wait_for_previous_kernel
from braid.runtime.lora.sgmv_kernels import programs_wanted


@triton.jit
def _bgmv_shrink_kernel(x_ptr, a_ptr, idx_ptr, h_ptr, K, RT, k_per_split, stride_xt, stride_an, stride_ar,
                        stride_hp, stride_ht, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(2)
    slot = tl.load(idx_ptr + t)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        k_start = split * k_per_split
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + t * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_an + r[:, None] * stride_ar + k[None, :],
                        mask=(r < RT)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + split * stride_hp + t * stride_ht + r, acc, mask=r < RT)


@triton.jit
def _bgmv_expand_kernel(y_ptr, h_ptr, b0_ptr, b1_ptr, b2_ptr, scale_ptr, idx_ptr, OUT, R, P, out0, out1, out2,
                        stride_yt, stride_hp, stride_ht, stride_b0n, stride_b0o, stride_b1n, stride_b1o, stride_b2n,
                        stride_b2o, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        USE_PDL: tl.constexpr):
    let_next_kernel_launch(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(idx_ptr + t)
    if slot >= 0:
        rk = tl.arange(0, BLOCK_R)
        r_ok = rk < R
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for s in tl.static_range(S):
            if s == 0:
                b_ptr, stride_bn, stride_bo, off, width = b0_ptr, stride_b0n, stride_b0o, 0, out0
            elif s == 1:
                b_ptr, stride_bn, stride_bo, off, width = b1_ptr, stride_b1n, stride_b1o, out0, out1
            else:
                b_ptr, stride_bn, stride_bo, off, width = b2_ptr, stride_b2n, stride_b2o, out0 + out1, out2
            within = cols - off
            c_ok = (within >= 0) & (within < width)
            h = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for p in range(P):
                h += tl.load(h_ptr + p * stride_hp + t * stride_ht + s * R + rk, mask=r_ok, other=0.0)
            b = tl.load(b_ptr + slot * stride_bn + within[:, None] * stride_bo + rk[None, :],
                        mask=c_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * h[None, :], axis=1)
        scale = tl.load(scale_ptr + slot).to(tl.float32)
        at = y_ptr + t * stride_yt + cols
        mask = cols < OUT
        y = tl.load(at, mask=mask, other=0.0)
        tl.store(at, (y.to(tl.float32) + scale * acc).to(y.dtype), mask=mask)


def bgmv_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, split_k: int = 0,
                block_k: int = 256) -> torch.Tensor:
    """x [T, K], a [N, RT, K], idx [T] -> h partials [P, T, RT] fp32 (split_k 0: enough splits to fill the SMs)."""
    t, k = x.shape
    rt = a.shape[1]
    block_r = min(64, max(16, triton.next_power_of_2(rt)))
    chunks = triton.cdiv(k, block_k)
    if not split_k:  # enough programs for every SM at small T
        sms = programs_wanted(x.device)
        split_k = max(1, min(chunks, 2 * sms // max(1, t * triton.cdiv(rt, block_r))))
    k_per_split = triton.cdiv(chunks, split_k) * block_k
    split = triton.cdiv(k, k_per_split)
    h = torch.empty(split, t, rt, dtype=torch.float32, device=x.device)
    if t == 0:
        return h
    _bgmv_shrink_kernel[(t, triton.cdiv(rt, block_r), split)](
        x, a, idx, h, k, rt, k_per_split, x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k, **pdl.launch_options(x.device))
    return h


def bgmv_expand(y: torch.Tensor, h: torch.Tensor, b_stacks: Sequence[torch.Tensor], scale: torch.Tensor,
                idx: torch.Tensor, block_n: int = 0) -> torch.Tensor:
    """y [T, sum(out_s)] += scale[idx] * h_s @ B_s[idx]^T per slice s (S <= 3), in place; h [P, T, S * R]."""
    t = y.shape[0]
    if t == 0:
        return y
    block_n = block_n or (32 if not y.is_cuda else 128)
    rank = h.shape[2] // len(b_stacks)
    outs = [b.shape[1] for b in b_stacks] + [0] * (3 - len(b_stacks))
    pad = list(b_stacks) + [b_stacks[0]] * (3 - len(b_stacks))
    _bgmv_expand_kernel[(t, triton.cdiv(y.shape[1], block_n))](
        y, h, pad[0], pad[1], pad[2], scale, idx, y.shape[1], rank, h.shape[0], outs[0], outs[1], outs[2],
        y.stride(0), h.stride(0), h.stride(1), pad[0].stride(0), pad[0].stride(1), pad[1].stride(0),
        pad[1].stride(1), pad[2].stride(0), pad[2].stride(1), S=len(b_stacks), BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), **pdl.launch_options(y.device))
    return y
