"""Linear layers. Weights are [out, in] like HF; tensor parallel sharding slices them on load."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers import cpu_gemm, triton_gemv
from braid.runtime.layers.activation import SiluAndMul
from braid.runtime.layers.norm import RMSNorm


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._packed: Optional[cpu_gemm.PackedLinearWeight] = None

    def prepack_weights(self) -> None:
        """After loading: a oneDNN-packed copy of the weight for CPU matmuls (no-op elsewhere)."""
        self._packed = cpu_gemm.PackedLinearWeight.pack(self.weight)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if triton_gemv.decode_gemv_applies(x, self.weight, bias):
            return triton_gemv.gemv(x, self.weight)[0]
        return cpu_gemm.linear(x, self.weight, bias, self._packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(Linear):
    """Output dim split over TP ranks. `output_sizes` lists fused sub-matrices (qkv, gate_up) so each is split on its own."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.tp_size = ps.tp_size()
        self.output_sizes = [s // self.tp_size for s in output_sizes]
        super().__init__(in_features, sum(self.output_sizes), bias)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> torch.Tensor:
        size = self.output_sizes[shard_id]
        rank = ps.tp_rank()
        return loaded.narrow(0, rank * size, size)


class RowParallelLinear(Linear):
    """Input dim split over TP ranks; the partial outputs are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp_size = ps.tp_size()
        super().__init__(in_features // self.tp_size, out_features, bias)

    def load_shard(self, param, loaded: torch.Tensor, shard_id: int = 0) -> torch.Tensor:
        if loaded.dim() == 1:
            return loaded
        size = self.in_features
        return loaded.narrow(1, ps.tp_rank() * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        if self.tp_size > 1:
            out = ps.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


def norm_linear_act(linear: Linear, x: torch.Tensor, norm=None, residual: Optional[torch.Tensor] = None,
                    act=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """act(linear(norm(x, residual))) -> (output, residual out), the norm (an RMSNorm, optional) returning the
    residual as RMSNorm.forward does (x itself when residual is None; None without a norm) and act optional
    (SiluAndMul over a [gate; up] linear). At decode batch 1 on CUDA this is one Triton GEMV launch."""
    silu = isinstance(act, SiluAndMul)
    # a row-parallel output still needs its all-reduce, which the GEMV does not do
    fusable = ((act is None or silu) and not isinstance(linear, RowParallelLinear)
               and (norm is None or (isinstance(norm, RMSNorm) and (residual is None or residual.dtype == x.dtype))))
    if fusable and triton_gemv.decode_gemv_applies(x, linear.weight, linear.bias):
        if norm is not None and not triton_gemv.FUSE_NORM:
            x, residual_out = (norm(x), x) if residual is None else norm(x, residual)
            return triton_gemv.gemv(x, linear.weight, silu_mul=silu)[0], residual_out
        return triton_gemv.gemv(x, linear.weight, norm_weight=None if norm is None else norm.weight,
                                residual=residual, eps=norm.eps if norm is not None else 1e-6,
                                unit_offset=bool(getattr(norm, "add_unit_offset", False)), silu_mul=silu)
    residual_out = None
    if norm is not None:
        if residual is None:
            x, residual_out = norm(x), x
        else:
            x, residual_out = norm(x, residual)
    y = linear(x)
    return (act(y) if act is not None else y), residual_out
