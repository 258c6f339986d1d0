"""Linear layers. Weights are [out, in] like HF; tensor parallel sharding slices them on load. How a layer
stores and multiplies its weight is its LinearMethod (quantization/): every matmul here goes through it."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers.quantization import LinearMethod, get_linear_method


class Linear(nn.Module):
    """y = x @ W^T (+ b). output_sizes: the sub-matrices stacked along out (qkv, gate_up), one by default."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 output_sizes: Optional[list[int]] = None, linear_method: Optional[LinearMethod] = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.output_sizes = list(output_sizes) if output_sizes is not None else [out_features]
        if sum(self.output_sizes) != out_features:
            raise ValueError(f"output_sizes {self.output_sizes} do not add up to out_features {out_features}")
        self.linear_method = linear_method if linear_method is not None else get_linear_method()
        self.linear_method.create_weights(self, in_features, self.output_sizes)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora = None  # a LoraLayer (runtime/lora/manager.py) when adapters are served

    def prepack_weights(self) -> None:
        """After loading: the method's post-load step (dense: a oneDNN-packed copy for CPU matmuls)."""
        self.linear_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor, act: Optional[nn.Module] = None) -> torch.Tensor:
        """act(x @ W^T + b); act (e.g. SiluAndMul over a [gate; up] weight) may be fused into the matmul."""
        if self.lora is not None and self.lora.active:
            if self.linear_method.takes_lora_epilogue(self, x):  # the batch-1 GEMV adds the delta before act
                return self.linear_method.apply(self, x, self.bias, act, lora=self.lora.gemv_epilogue(x))
            # elsewhere the adapter's delta joins before the activation, so act is not fused into the matmul
            y = self.lora.add_delta(x, self.linear_method.apply(self, x, self.bias))
            return y if act is None else act(y)
        return self.linear_method.apply(self, x, self.bias, act)


def _rank_part(loaded: torch.Tensor, dim: int, full: int, start: int, size: int, what: str) -> torch.Tensor:
    """This rank's [start, start + size) of `loaded` along dim: sliced here from the whole tensor, or already sliced
    by the loader (safetensors slices; then its length is `size`)."""
    length = loaded.shape[dim]
    if length == full:
        return loaded.narrow(dim, start, size)
    if length == size:
        return loaded
    raise ValueError(f"{what}: checkpoint dim {dim} is {length}, expected {full} (whole) or {size} (this rank's part)")


class ColumnParallelLinear(Linear):
    """Output dim split over TP ranks. `output_sizes` lists fused sub-matrices (qkv, gate_up) so each is split on its
    own, as evenly as it goes; `shard_ranges` gives this rank's (start, size) of each instead (attention: whole KV
    groups, replicated KV heads)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, *,
                 shard_ranges: Optional[list[tuple[int, int]]] = None, linear_method: Optional[LinearMethod] = None):
        self.tp_size = ps.tp_size()
        self.full_output_sizes = list(output_sizes)
        if shard_ranges is None:
            shard_ranges = [ps.split_units(full, f"output part {i} of a {in_features}->{output_sizes} linear")
                            for i, full in enumerate(output_sizes)]
        self.shard_starts = [start for start, _ in shard_ranges]
        sizes = [size for _, size in shard_ranges]
        super().__init__(in_features, sum(sizes), bias, output_sizes=sizes, linear_method=linear_method)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> torch.Tensor:
        return _rank_part(loaded, 0, self.full_output_sizes[shard_id], self.shard_starts[shard_id],
                          self.output_sizes[shard_id], type(self).__name__)

    def rank_range(self, attr: str, shard_id: Optional[int], shape: list[int]) -> Optional[tuple[int, int, int]]:
        """(dim, start, stop) of this rank's part of a checkpoint tensor of `shape`, for the sharded loader."""
        sid = shard_id or 0
        if not shape or shape[0] != self.full_output_sizes[sid]:
            return None
        return 0, self.shard_starts[sid], self.shard_starts[sid] + self.output_sizes[sid]


class RowParallelLinear(Linear):
    """Input dim split over TP ranks; the partial outputs are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 shard_range: Optional[tuple[int, int]] = None, linear_method: Optional[LinearMethod] = None):
        """shard_range: this rank's (start, size) of the input (attention: its heads' columns); default an even split."""
        self.tp_size = ps.tp_size()
        self.full_in_features = in_features
        first, count = shard_range or ps.split_units(in_features, f"input of a {in_features}->{out_features} linear")
        self.in_start = first
        super().__init__(count, out_features, bias, linear_method=linear_method)

    def load_shard(self, param, loaded: torch.Tensor, shard_id: int = 0) -> torch.Tensor:
        if loaded.dim() == 1:
            return loaded
        return _rank_part(loaded, 1, self.full_in_features, self.in_start, self.in_features, type(self).__name__)

    def rank_range(self, attr: str, shard_id: Optional[int], shape: list[int]) -> Optional[tuple[int, int, int]]:
        if len(shape) != 2 or shape[1] != self.full_in_features:
            return None
        return 1, self.in_start, self.in_start + self.in_features

    def forward(self, x: torch.Tensor, act: Optional[nn.Module] = None) -> torch.Tensor:
        # the bias and act come after the all-reduce of the partial sums
        out = self.linear_method.apply(self, x)
        if self.lora is not None and self.lora.active:  # this rank's partial delta joins its partial sums
            out = self.lora.add_delta(x, out)
        out = ps.all_reduce(out)  # a no-op without a distributed world
        if self.bias is not None:
            out = out + self.bias
        return out if act is None else act(out)


def norm_linear_act(linear: Linear, x: torch.Tensor, norm=None, residual: Optional[torch.Tensor] = None,
                    act=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """act(linear(norm(x, residual))) -> (output, residual out), the norm (optional) returning the residual as
    RMSNorm.forward does (x itself when residual is None; None without a norm) and act optional (SiluAndMul
    over a [gate; up] linear, fused into the matmul where the linear's method can: the dense batch-1 GEMV)."""
    residual_out = None
    if norm is not None:
        if residual is None:
            x, residual_out = norm(x), x
        else:
            x, residual_out = norm(x, residual)
    return linear(x, act), residual_out
