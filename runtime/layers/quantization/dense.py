"""Dense weights in the activation dtype (bf16/fp16/fp32).

Kernels: braid's Triton GEMV for batch-1 bf16/fp16 on CUDA (a decode step's qkv projection with rotary and the KV
write as its epilogue) and its tensor-core form for 2..16 rows on the shapes where
it was measured faster than cuBLAS (SiLU- or GELU-tanh-and-mul fused after them; gemv.py, small_batch_gemm.py; the
batch-1 GEMV also takes a LoRA adapter's delta into its epilogue), a
oneDNN-prepacked copy of the weight on CPU (cpu_gemm.py), F.linear everywhere else.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from braid.runtime.layers import cpu_gemm, gemv, small_batch_gemm
from braid.runtime.layers.activation import GeluAndMul, SiluAndMul
from braid.runtime.layers.quantization.base import LinearMethod


def _fused_activation(act: Optional[nn.Module]) -> str:
    """The gated activation the GEMV kernels fuse for `act` ("silu", "gelu"), or "" (none, or one they do not fuse)."""
    if isinstance(act, SiluAndMul):
        return "silu"
    if isinstance(act, GeluAndMul) and act.approximate == "tanh":
        return "gelu"
    return ""


class DenseLinearMethod(LinearMethod):
    name = "dense"

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int]) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(output_sizes), in_features), requires_grad=False)
        layer.cpu_packed_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.cpu_packed_weight = cpu_gemm.PackedLinearWeight.pack(layer.weight)

    def takes_lora_epilogue(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return gemv.decode_gemv_applies(x, layer.weight, layer.bias)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
              act: Optional[nn.Module] = None, lora: Optional[gemv.LoraEpilogue] = None) -> torch.Tensor:
        """lora: an adapter's delta for the batch-1 GEMV to add before act (only where takes_lora_epilogue)."""
        weight = layer.weight
        fused = _fused_activation(act)
        if gemv.decode_gemv_applies(x, weight, bias):
            if isinstance(act, gemv.RotaryKVStore):  # a decode step's qkv: rotary and the KV write in the epilogue
                q = gemv.gemv_rotary_store(x, weight, act, lora=lora)
                if q is not None:
                    return q
            y = gemv.gemv(x, weight, silu_mul=fused == "silu", gelu_tanh_mul=fused == "gelu", lora=lora)
        elif lora is not None:
            raise ValueError("a LoRA epilogue needs the batch-1 GEMV (takes_lora_epilogue)")
        elif small_batch_gemm.small_batch_gemm_applies(x, weight, bias, fused):
            y = small_batch_gemm.small_batch_gemm(x, weight, activation=fused)
        else:
            y, fused = cpu_gemm.linear(x, weight, bias, layer.cpu_packed_weight), ""
        return y if act is None or fused else act(y)
