"""The LoRA delta as two SGMV-shaped ops, torch reference on any device: y += scale * (x @ A^T) @ B^T per row, each
row on its own adapter. `idx` holds one adapter slot per row (-1: the base model, no delta). A Triton SGMV kernel
(one launch over segments of rows sharing an adapter) is meant to replace these bodies behind the same signatures.

`groups` is the host's list of (slot, row indices) for the batch, computed once per forward pass by the manager so
that each layer's call needs no device-to-host sync; without it the ops derive it from `idx`."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

Groups = Sequence[tuple[int, torch.Tensor]]


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
    h[t] = A[idx[t]] @ x[t] (zeros on base rows)."""
    h = x.new_zeros(x.shape[0], a_stack.shape[1])
    for slot, rows in (groups if groups is not None else adapter_groups(idx)):
        h[rows] = x[rows] @ a_stack[slot].t()
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b_stacks: Sequence[torch.Tensor], scale: torch.Tensor,
                idx: torch.Tensor, groups: Optional[Groups] = None) -> torch.Tensor:
    """Adds the delta into y in place and returns it. y: [T, sum(out_s)], the outputs of S stacked sub-matrices
    (qkv, gate_up; S = 1 for a plain linear); h: [T, S * R] from lora_shrink over A stacked [N, S * R, in];
    b_stacks: S tensors [N, out_s, R]; scale: [N] (lora_alpha / r, or / sqrt(r) with rslora).
    Sub-matrix s: y[:, off_s : off_s + out_s] += scale[idx] * h[:, s*R : (s+1)*R] @ B_s[idx]^T."""
    rank = h.shape[1] // len(b_stacks)
    for slot, rows in (groups if groups is not None else adapter_groups(idx)):
        hs = h[rows] * scale[slot]
        off = 0
        for s, b in enumerate(b_stacks):
            out_s = b.shape[1]
            y[rows, off:off + out_s] += hs[:, s * rank:(s + 1) * rank] @ b[slot].t()
            off += out_s
    return y
