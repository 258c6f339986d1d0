"""The LoRA delta as two SGMV-shaped ops: y += scale * (x @ A^T) @ B^T per row, each row on its own adapter. `idx`
holds one adapter slot per row (-1: the base model, no delta). CUDA tensors take Triton kernels (one launch per op,
adapters gathered by `idx` on the device, `groups` unused): the per-row ones of bgmv_kernels.py for batches of up to
BGMV_MAX_ROWS rows, the row-block ones of sgmv_kernels.py above; other devices the torch reference below.

`groups` is the host's list of (slot, row indices) for the batch, computed once per forward pass by the manager so
that each layer's call of the torch path needs no device-to-host sync; without it the ops derive it from `idx`."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from braid.runtime.lora.bgmv_kernels import bgmv_expand, bgmv_shrink
from braid.runtime.lora.sgmv_kernels import row_order, sgmv_expand, sgmv_shrink

Groups = Sequence[tuple[int, torch.Tensor]]

# Rows up to which a batch takes the per-row kernels: SGMV's loop over the adapters present in a row block is what
# costs at a few rows on many adapters, its row tiles what pays on long batches (docs/benchmarks.md, LoRA kernels).
BGMV_MAX_ROWS = 32


def adapter_groups(idx: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """idx: [T] int -> [(slot, rows [n] int64)] for every slot >= 0 present (a host sync: call once per batch)."""
    out = []
    for slot in torch.unique(idx).tolist():
        if slot >= 0:
            out.append((int(slot), torch.nonzero(idx == slot).flatten()))
    return out


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, idx: torch.Tensor,
                groups: Optional[Groups] = None) -> torch.Tensor:
    """x: [T, in], a_stack: [N, R, in] (slot n's A, rank padded to R with zero rows), idx: [T] -> h [T, R],
    h[t] = A[idx[t]] @ x[t] (zeros on base rows). On CUDA h comes as the kernel's fp32 partial sums [P, T, R]
    (h = their sum over dim 0), which lora_expand takes as they are."""
    if x.is_cuda:
        if x.shape[0] <= BGMV_MAX_ROWS:
            return bgmv_shrink(x, a_stack, idx)
        return sgmv_shrink(x, a_stack, idx, row_order(idx))
    return shrink_reference(x, a_stack, idx, groups)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b_stacks: Sequence[torch.Tensor], scale: torch.Tensor,
                idx: torch.Tensor, groups: Optional[Groups] = None) -> torch.Tensor:
    """Adds the delta into y in place and returns it. y: [T, sum(out_s)], the outputs of S stacked sub-matrices
    (qkv, gate_up; S = 1 for a plain linear); h: [T, S * R] from lora_shrink over A stacked [N, S * R, in];
    b_stacks: S tensors [N, out_s, R]; scale: [N] (lora_alpha / r, or / sqrt(r) with rslora).
    Sub-matrix s: y[:, off_s : off_s + out_s] += scale[idx] * h[:, s*R : (s+1)*R] @ B_s[idx]^T.
    h may also be lora_shrink's CUDA partial sums [P, T, S * R]."""
    if y.is_cuda and len(b_stacks) <= 3:
        if y.shape[0] <= BGMV_MAX_ROWS:
            return bgmv_expand(y, h, b_stacks, scale, idx)
        return sgmv_expand(y, h, b_stacks, scale, idx, row_order(idx))
    if h.dim() == 3:
        h = h.sum(0).to(y.dtype)
    return expand_reference(y, h, b_stacks, scale, idx, groups)


def shrink_reference(x: torch.Tensor, a_stack: torch.Tensor, idx: torch.Tensor,
                     groups: Optional[Groups] = None) -> torch.Tensor:
    """lora_shrink in torch, one matmul per adapter present (any device): h [T, R] in x's dtype."""
    h = x.new_zeros(x.shape[0], a_stack.shape[1])
    for slot, rows in (groups if groups is not None else adapter_groups(idx)):
        h[rows] = x[rows] @ a_stack[slot].t()
    return h


def expand_reference(y: torch.Tensor, h: torch.Tensor, b_stacks: Sequence[torch.Tensor], scale: torch.Tensor,
                     idx: torch.Tensor, groups: Optional[Groups] = None) -> torch.Tensor:
    """lora_expand in torch, S matmuls per adapter present (any device), h [T, S * R]."""
    rank = h.shape[1] // len(b_stacks)
    for slot, rows in (groups if groups is not None else adapter_groups(idx)):
        hs = h[rows] * scale[slot]
        off = 0
        for s, b in enumerate(b_stacks):
            out_s = b.shape[1]
            y[rows, off:off + out_s] += hs[:, s * rank:(s + 1) * rank] @ b[slot].t()
            off += out_s
    return y
