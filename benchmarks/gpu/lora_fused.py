"""A one-launch LoRA delta for decode rows, the candidate lora_sgmv.py times beside the runtime's BGMV and SGMV
kernels: shrink and expand in one kernel, so a targeted linear costs one launch instead of two. Not wired into the
runtime: the measurement decides.

  grid (T, column blocks); program (t, block) with slot = idx[t] >= 0, for each output slice s the block overlaps:
    h_s = A[slot][s*R : (s+1)*R] @ x[t]            (R values, the whole K reduction, in fp32)
    y[t, cols] += scale[slot] * B_s[slot][cols - off_s] @ h_s
  Every column block of a row recomputes its slices' h from A (R x K, read from L2 after the first program): the
  trade is R x K reads per program against a second launch and the partials' round trip.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (`python benchmarks/gpu/lora_fused.py` checks it against
the runtime's torch reference there).
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_fused_kernel(x_ptr, a_ptr, b0_ptr, b1_ptr, b2_ptr, scale_ptr, idx_ptr, y_ptr, K, R, OUT, out0, out1, out2,
                       stride_xt, stride_an, stride_ar, stride_b0n, stride_b0o, stride_b1n, stride_b1o, stride_b2n,
                       stride_b2o, stride_yt, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    lo = tl.program_id(1) * BLOCK_N
    cols = lo + tl.arange(0, BLOCK_N)
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
            if (lo < off + width) & (lo + BLOCK_N > off):
                h = tl.zeros((BLOCK_R,), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    k_ok = k < K
                    xv = tl.load(x_ptr + t * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
                    a = tl.load(a_ptr + slot * stride_an + (s * R + rk[:, None]) * stride_ar + k[None, :],
                                mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                    h += tl.sum(a * xv[None, :], axis=1)
                within = cols - off
                c_ok = (within >= 0) & (within < width)
                b = tl.load(b_ptr + slot * stride_bn + within[:, None] * stride_bo + rk[None, :],
                            mask=c_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(b * h[None, :], axis=1)
        scale = tl.load(scale_ptr + slot).to(tl.float32)
        at = y_ptr + t * stride_yt + cols
        mask = cols < OUT
        y = tl.load(at, mask=mask, other=0.0)
        tl.store(at, (y.to(tl.float32) + scale * acc).to(y.dtype), mask=mask)


def lora_fused(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_stacks: Sequence[torch.Tensor],
               scale: torch.Tensor, idx: torch.Tensor, block_n: int = 0, block_k: int = 0) -> torch.Tensor:
    """y [T, sum(out_s)] += scale[idx] * B_s[idx] (A_s[idx] x) per slice s (S <= 3), in place. x [T, K],
    a [N, S * R, K], b_stacks S x [N, out_s, R], scale [N], idx [T] (-1: row untouched)."""
    t = y.shape[0]
    if t == 0:
        return y
    rank = a.shape[1] // len(b_stacks)
    block_n = block_n or (32 if not y.is_cuda else 128)
    block_k = block_k or (32 if not y.is_cuda else 256)
    outs = [b.shape[1] for b in b_stacks] + [0] * (3 - len(b_stacks))
    pad = list(b_stacks) + [b_stacks[0]] * (3 - len(b_stacks))
    _lora_fused_kernel[(t, triton.cdiv(y.shape[1], block_n))](
        x, a, pad[0], pad[1], pad[2], scale, idx, y, x.shape[1], rank, y.shape[1], outs[0], outs[1], outs[2],
        x.stride(0), a.stride(0), a.stride(1), pad[0].stride(0), pad[0].stride(1), pad[1].stride(0),
        pad[1].stride(1), pad[2].stride(0), pad[2].stride(1), y.stride(0), S=len(b_stacks), BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=block_k)
    return y


def main() -> int:
    """Checks lora_fused against the runtime's torch reference (CPU under TRITON_INTERPRET=1, or CUDA): several
    slices, blocks straddling slice borders, base rows untouched, ranks padded."""
    from braid.runtime.lora.ops import expand_reference, shrink_reference

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    for t, n, outs, k, r in ((1, 4, [48], 96, 8), (5, 3, [40, 24, 24], 80, 4), (9, 6, [40, 24], 64, 16)):
        idx = torch.randint(-1, n, (t,), generator=gen)
        idx[0] = n - 1
        x = torch.randn(t, k, generator=gen)
        a = torch.randn(n, len(outs) * r, k, generator=gen) * 0.1
        b = [torch.randn(n, o, r, generator=gen) * 0.1 for o in outs]
        scale = torch.rand(n, generator=gen) + 0.5
        y = torch.randn(t, sum(outs), generator=gen)
        want = expand_reference(y.clone(), shrink_reference(x, a, idx), b, scale, idx)
        got = lora_fused(y.clone().to(dev), x.to(dev), a.to(dev), [v.to(dev) for v in b], scale.to(dev),
                         idx.to(dev)).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got[idx < 0], y[idx < 0])
        print(f"T={t} adapters={n} slices={outs} K={k} R={r}: equal to the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
