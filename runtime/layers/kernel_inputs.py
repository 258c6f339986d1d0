"""Input checks and views shared by the per-token Triton kernels (norm, activation, rotary, KV store)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["FusedKernelInputError", "rows_view", "token_rows_stride"]


class FusedKernelInputError(ValueError):
    """Tensors of the wrong shape, layout or device for a fused kernel."""


def rows_view(x: torch.Tensor, name: str) -> torch.Tensor:
    """-> a 2-D view [rows, last dim] with unit stride in the last dim (a copy only if no such view exists)."""
    if x.dim() == 0:
        raise FusedKernelInputError(f"{name} must have at least one dimension")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def token_rows_stride(x: torch.Tensor, tokens: int, width: int) -> Optional[int]:
    """Row stride of x viewed as [tokens, width] with unit stride inside a row, or None if it has no such view."""
    if x.numel() != tokens * width:
        return None
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x.stride(0)
    if x.dim() == 2 and x.stride(1) == 1:
        return x.stride(0)
    return None
