"""LinearMethod: how a linear layer stores its weight and multiplies by it.

A layer (Linear and its parallel variants, LMHead) owns its shape and bias; its method owns the weight's
storage and the matmul. Dense keeps W [out, in] in the activation dtype; a quantized method keeps, say, an
fp8 W with per-channel or per-tensor scales next to it (registered as parameters on the layer, so the loader
fills them by name), quantizes a dense checkpoint in `process_weights_after_loading`, and multiplies with
torch._scaled_mm or its own kernel in `apply`. One method instance serves many layers: per-layer state lives
on the layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
from torch import nn


class LinearMethod(ABC):
    name: str

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int]) -> None:
        """Register the layer's weight parameters on the current device (meta while a model is built).

        output_sizes: the rows of each sub-matrix stacked along out (qkv: [q, k, v]; one entry when nothing is
        fused), already split for this TP rank; a method with per-tensor scales keeps one per entry."""

    def load_weight(self, layer: nn.Module, attr: str, loaded: torch.Tensor, shard_id: Optional[int],
                    device) -> bool:
        """Place a checkpoint tensor named `attr` of this layer (its `shard_id` of a fused layer) if the method
        lays it out itself (fp8: its scales); False leaves it to the generic loader (a copy into the parameter)."""
        return False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """After every checkpoint tensor is in place (and weights are tied): re-lay-out or quantize. Runs again
        whenever the weights change."""

    def takes_lora_epilogue(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether apply(..., lora=...) adds a LoRA delta (gemv.LoraEpilogue) inside its kernel for this x; else the
        layer adds it to apply's output (a shrink and an expand)."""
        return False

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
              act: Optional[nn.Module] = None) -> torch.Tensor:
        """act(x @ W^T + bias): x [T, in] -> [T, out] in x's dtype (act halves out for a [gate; up] weight).

        act is an activation module such as SiluAndMul; a method may fuse it into its kernel, else it calls it."""
