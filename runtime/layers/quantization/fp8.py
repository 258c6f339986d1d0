"""FP8 (e4m3) linear layers: `--quantization fp8`, or a checkpoint whose config says fp8.

Two sources of weights:
- a dense checkpoint (bf16/fp16/fp32), quantized in `process_weights_after_loading` with one scale per output
  row (max |w| of the row at 448);
- an FP8 checkpoint: `quantization_config.quant_method == "fp8"` (the HF / vLLM / AutoFP8 layout) or
  compressed-tensors' `float-quantized` format, with `weight` in e4m3, `weight_scale` per tensor (one value) or
  per channel ([N] or [N, 1]), and for static activation schemes an `input_scale` per tensor. Block-wise scales
  (`weight_block_size`) are refused.

Storage on the layer after loading: `weight` e4m3 [N, K] and `weight_scale` fp32 [N], one scale per output row
whatever the checkpoint had. Fused layers (qkv, gate_up) whose shards came with one scale each keep them
per shard by writing each shard's scale on its rows: exact, no requantization. A static checkpoint's
`input_scale`s (one per shard) become one: their maximum (the shards read the same input).

Multiplication (`apply`), y = act(x @ W^T + b) in x's dtype:
- CUDA, one row of x (batch-1 decode), no bias: fp8_gemv.fp8_gemv (a variant of gemv.py's Triton GEMV) streams
  the fp8 weight and multiplies by the row scales, SiLU-and-mul fused for a [gate; up] weight (and for a decode step's qkv rotary and
  the KV write, where the pool lets a kernel write: fp8_gemv.fp8_gemv_rotary_store), launched with PDL; x stays
  bf16.
- CUDA, 2..16 rows (small decode batches), no bias: fp8_gemv.fp8_gemv's tensor-core variant, one launch that
  streams W once through fp8 dots against x's rows (each rounded to e4m3 per row and chunk in the kernel),
  SiLU-and-mul fused. Both follow --disable-decode-gemv (then _scaled_mm below).
- CUDA otherwise: x quantized per token (or by the static scale) in one Triton launch, then torch._scaled_mm
  with row-wise scales (sm90 supports them with a bf16 output; so fp8 on CUDA needs --dtype bfloat16), or
  tensor-wise when the activation scale is static and every row of W has the same scale.
- CPU: x quantized per token as on CUDA and multiplied by a dequantized copy of W (made at load, prepacked like
  a dense weight). torch._scaled_mm exists on CPU but ran 6x slower than an fp32 GEMM (SmolLM2's gate_up at
  64 tokens: 51 vs 8.6 ms), and the values are the same: fp8 products accumulated in fp32. So CPU runs show FP8's
  accuracy, not its memory savings.

Embedding and LM head stay in the model dtype (they are not `Linear` layers). Which layers take this method (all
`Linear`s but those the checkpoint ignores) is decided at load: loader/fp8_layers.py.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

import torch
from torch import nn

from braid.runtime.layers import cpu_gemm, gemv
from braid.runtime.layers.activation import SiluAndMul
from braid.runtime.layers.quantization.base import LinearMethod
from braid.runtime.layers.quantization.fp8_gemv import SMALL_BATCH_MAX_ROWS, fp8_gemv, fp8_gemv_rotary_store
from braid.runtime.layers.quantization.fp8_quantize import (FP8_DTYPE, quantize_rows, quantize_weight_per_channel,
                                                            scaled_mm)

__all__ = ["Fp8LinearMethod", "split_kv_cache_scales"]

logger = logging.getLogger(__name__)

# per-layer KV-cache scales in FP8 checkpoints: self_attn.k_scale (vLLM, compressed-tensors), self_attn.attn.k_scale,
# or the k/v projections' output_scale (AutoFP8's first exports)
_KV_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(?:([kv])_scale|([kv])_proj\.output_scale)$")


class Fp8LinearMethod(LinearMethod):
    """from_checkpoint: the checkpoint stores e4m3 weights and scales (else dense weights are quantized at load);
    static_activations: it also stores an input_scale per layer (activation_scheme 'static')."""

    name = "fp8"

    def __init__(self, from_checkpoint: bool = False, static_activations: bool = False):
        if static_activations and not from_checkpoint:
            raise ValueError("static activation scales come from an FP8 checkpoint")
        self.from_checkpoint = from_checkpoint
        self.static_activations = static_activations

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int]) -> None:
        rows = sum(output_sizes)
        if self.from_checkpoint:
            layer.weight = nn.Parameter(torch.empty(rows, in_features, dtype=FP8_DTYPE), requires_grad=False)
            layer.weight_scale = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
            if self.static_activations:
                # one per shard while loading; their maximum after
                layer.input_scale = nn.Parameter(torch.empty(len(output_sizes), dtype=torch.float32),
                                                 requires_grad=False)
        else:
            # the checkpoint's dense weight, quantized in process_weights_after_loading
            layer.weight = nn.Parameter(torch.empty(rows, in_features), requires_grad=False)
        if not self.static_activations:
            layer.input_scale = None
        layer.fp8_tensorwise = False
        layer.cpu_dequantized_weight = None
        layer.cpu_packed_weight = None

    def load_weight(self, layer: nn.Module, attr: str, loaded: torch.Tensor, shard_id: Optional[int],
                    device) -> bool:
        if attr == "weight":
            if loaded.dtype in (torch.float8_e5m2, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz):
                raise ValueError(f"FP8 weights in {loaded.dtype} are not supported; braid reads float8_e4m3fn")
            return False  # the generic loader copies it (shards included), in the checkpoint's dtype
        if attr == "weight_scale":
            param = self._materialized(layer, attr, layer.weight_scale.shape, device)
            sizes = layer.output_sizes
            sid = 0 if shard_id is None else shard_id
            rows = sizes[sid] if shard_id is not None else sum(sizes)
            offset = sum(sizes[:sid]) if shard_id is not None else 0
            scale = loaded.to(torch.float32).reshape(-1)
            if scale.numel() != 1:  # per channel: this rank's rows
                if hasattr(layer, "load_shard"):
                    scale = layer.load_shard(param, scale, sid)
                if scale.numel() != rows:
                    raise ValueError(f"weight_scale of {scale.numel()} values for {rows} rows: FP8 checkpoints "
                                     f"need one scale per tensor or per output channel")
            param.data.narrow(0, offset, rows).copy_(scale.to(param.device))
            return True
        if attr == "input_scale":
            if not self.static_activations:
                raise ValueError("the checkpoint has input_scale tensors but its config does not say "
                                 "activation_scheme 'static'")
            param = self._materialized(layer, attr, layer.input_scale.shape, device)
            if loaded.numel() != 1:
                raise ValueError(f"input_scale must be one value per tensor, got shape {tuple(loaded.shape)}")
            param.data[0 if shard_id is None else shard_id] = loaded.to(torch.float32).reshape(())
            return True
        return False

    @staticmethod
    def _materialized(layer: nn.Module, attr: str, shape, device) -> nn.Parameter:
        param = getattr(layer, attr)
        if param.is_meta:
            # NaN marks entries no checkpoint tensor filled (checked after loading)
            param = nn.Parameter(torch.full(shape, float("nan"), dtype=torch.float32, device=device),
                                 requires_grad=False)
            setattr(layer, attr, param)
        return param

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        stored = [getattr(layer, name, None) for name in ("weight", "weight_scale", "input_scale")]
        if any(p is not None and p.is_meta for p in stored):
            return  # a tensor the checkpoint lacks: the loader names it ("weights missing from the checkpoint")
        if weight.dtype != FP8_DTYPE:
            if self.from_checkpoint:
                raise ValueError(f"an FP8 checkpoint layer ({getattr(layer, 'fp8_name', '?')}) holds a {weight.dtype} "
                                 "weight; list it in the config's ignored layers to keep it dense")
            quantized, scale = quantize_weight_per_channel(weight)
            layer.weight = nn.Parameter(quantized, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        scale = layer.weight_scale
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise ValueError(f"weight_scale of {getattr(layer, 'fp8_name', 'a layer')} is missing for a shard or not "
                             "positive")
        if self.static_activations:
            input_scale = layer.input_scale
            if not bool(torch.isfinite(input_scale).all()) or not bool((input_scale > 0).all()):
                raise ValueError(f"input_scale of {getattr(layer, 'fp8_name', 'a layer')} is missing for a shard or "
                                 "not positive")
            if input_scale.numel() > 1:
                layer.input_scale = nn.Parameter(input_scale.max().reshape(1), requires_grad=False)
        layer.fp8_tensorwise = self.static_activations and bool((scale == scale[0]).all())
        if weight.device.type == "cuda":
            out_rows, in_features = layer.weight.shape
            if in_features % 16 or out_rows % 16:
                raise ValueError(f"fp8 layer {getattr(layer, 'fp8_name', '')} is [{out_rows}, {in_features}]; "
                                 "torch._scaled_mm needs both dims to be multiples of 16")
            layer.cpu_dequantized_weight = layer.cpu_packed_weight = None
        else:
            dequantized = layer.weight.to(torch.float32) * scale[:, None]
            layer.cpu_dequantized_weight = dequantized
            layer.cpu_packed_weight = cpu_gemm.PackedLinearWeight.pack(dequantized)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
              act: Optional[nn.Module] = None) -> torch.Tensor:
        weight, scale = layer.weight, layer.weight_scale
        if x.shape[0] == 0:  # no tokens: torch._scaled_mm and the kernels want at least one row
            y = x.new_zeros((0, weight.shape[0]))
        elif x.is_cuda:
            if bias is None and gemv.enabled() and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_MAX_ROWS:
                fused = isinstance(act, SiluAndMul)
                y = None
                if isinstance(act, gemv.RotaryKVStore):  # a decode step's qkv: rotary and the KV write in the epilogue
                    q = fp8_gemv_rotary_store(x, weight, scale, act)
                    if q is not None:
                        return q
                if gemv.fp8_supports(x, weight, scale):
                    y = fp8_gemv(x.contiguous(), weight, scale, silu_mul=fused)
                elif x.shape[0] > 1 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1:
                    y = fp8_gemv(x, weight, scale, silu_mul=fused)
                if y is not None:
                    return y if fused or act is None else act(y)
            x_q, x_scale = quantize_rows(x, layer.input_scale)
            y = scaled_mm(x_q, x_scale, weight, scale, x.dtype, bias, tensorwise=layer.fp8_tensorwise)
        else:
            x_q, x_scale = quantize_rows(x, layer.input_scale)
            dequantized = layer.cpu_dequantized_weight
            y = cpu_gemm.linear(x_q.to(dequantized.dtype) * x_scale, dequantized, None,
                                layer.cpu_packed_weight).to(x.dtype)
            if bias is not None:
                y = y + bias
        return y if act is None else act(y)


def split_kv_cache_scales(weights, num_layers: int, found: dict):
    """Pass a checkpoint's (name, tensor) stream on without its KV-cache scales, which go into
    found[(layer, 'k' | 'v')] = float."""
    for name, tensor in weights:
        match = _KV_SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        layer = int(match.group(1))
        if not 0 <= layer < num_layers or tensor.numel() != 1:
            raise ValueError(f"KV-cache scale {name} of shape {tuple(tensor.shape)}: braid reads one scale per layer")
        found[(layer, match.group(2) or match.group(3))] = float(tensor.float().reshape(()))
