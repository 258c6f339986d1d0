from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm; with `residual` it fuses the residual add: returns (normed(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, add_unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.add_unit_offset = add_unit_offset  # Gemma stores weight - 1

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if x.is_cuda and (residual is None or residual.dtype == x.dtype):
            from braid.runtime.layers import norm_kernels

            if residual is None:
                return norm_kernels.rmsnorm(x, self.weight, self.eps, self.add_unit_offset)
            return norm_kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps, self.add_unit_offset)
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """The PyTorch reference (CPU path)."""
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float() + 1.0 if self.add_unit_offset else self.weight.float()
        out = (xf * w).to(orig_dtype)
        return out if residual is None else (out, residual)
