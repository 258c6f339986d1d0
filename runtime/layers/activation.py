from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    # x: [T, 2 * I] -> [T, I]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from braid.runtime.layers import activation_kernels

            return activation_kernels.silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.approximate in ("tanh", "none"):
            from braid.runtime.layers import activation_kernels

            return activation_kernels.gelu_and_mul(x, self.approximate)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
