"""Which layers of a model built on meta become fp8 (`--quantization fp8`, or a checkpoint whose config says fp8),
before its weights load: every `Linear` but those the checkpoint's `ignored_layers` / `ignore` name (names or `re:`
patterns, in the checkpoint's own names; a fused layer must have all of its shards ignored or none), and the MoE
experts. The layers' fp8 storage and multiplication are layers/quantization/fp8.py's."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from braid.runtime.layers.linear import Linear
from braid.runtime.layers.moe import FusedMoE
from braid.runtime.layers.quantization.fp8 import Fp8LinearMethod
from braid.runtime.layers.quantization.fp8_quantize import check_fp8_device

__all__ = ["use_fp8_linears"]

logger = logging.getLogger(__name__)


def _is_ignored(name: str, ignored: tuple[str, ...]) -> bool:
    for entry in ignored:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name):
                return True
        elif name == entry:
            return True
    return False


def _checkpoint_names(model: nn.Module, module_name: str) -> list[str]:
    """A module's names in the checkpoint: its shards' for a fused module (qkv_proj -> q_proj, k_proj, v_proj)."""
    shards = sorted((sid, hf) for fused, hf, sid in getattr(model, "stacked_params", ())
                    if module_name.endswith("." + fused))
    prefix = module_name.rpartition(".")[0]
    return [f"{prefix}.{hf}" for _, hf in shards] or [module_name]


def use_fp8_linears(model: nn.Module, model_config, device: torch.device, dtype: torch.dtype) -> int:
    """Give every `Linear` of a model built on meta the fp8 method (before its weights load), but the ignored
    ones. The checkpoint's quantization_config (ModelConfig.quantization) says whether its weights are fp8
    already; without one, dense weights are quantized at load. -> how many layers are fp8."""
    check_fp8_device(device)
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"--quantization fp8 on CUDA computes in bfloat16 (torch._scaled_mm's row-wise scales need "
                         f"a bf16 output); got --dtype {str(dtype).removeprefix('torch.')}")
    if model_config.vision is not None:
        raise ValueError(f"--quantization fp8 is built for text models so far, not {model_config.architecture}")
    spec = model_config.quantization
    ignored: tuple[str, ...] = ()
    if spec is None:
        method = Fp8LinearMethod()
    else:
        if spec.method != "fp8":
            raise ValueError(f"--quantization fp8 cannot read a checkpoint quantized as {spec.method!r}")
        if spec.weight_block_size is not None:
            raise ValueError(f"block-wise FP8 checkpoints (weight_block_size {list(spec.weight_block_size)}) are not "
                             "supported; braid reads per-tensor or per-channel weight scales")
        if spec.activation_scheme not in (None, "dynamic", "static"):
            raise ValueError(f"FP8 activation_scheme {spec.activation_scheme!r} is not supported (dynamic, static)")
        method = Fp8LinearMethod(from_checkpoint=True, static_activations=spec.activation_scheme == "static")
        ignored = spec.ignored_layers
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        names = _checkpoint_names(model, name)
        ignored_names = [n for n in names if _is_ignored(n, ignored)]
        if ignored_names:
            if len(ignored_names) != len(names):
                raise ValueError(f"the checkpoint ignores {ignored_names} but not the rest of {names}, which braid "
                                 "fuses into one layer")
            continue
        module.linear_method = method
        module.fp8_name = name
        with torch.device("meta"):  # like the rest of the model until its weights load
            method.create_weights(module, module.in_features, module.output_sizes)
        count += 1
    logger.info("fp8: %d linear layers in e4m3 (%s), embedding and LM head in %s", count,
                "from the checkpoint" if method.from_checkpoint else "quantized at load, per-channel scales",
                str(dtype).removeprefix("torch."))
    if model_config.moe is not None:
        moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        for moe in moe_layers:
            moe.use_fp8()
        logger.info("fp8: the experts of %d MoE layers in e4m3 with per-row scales (%s), the router in fp32",
                    len(moe_layers), "from the checkpoint" if method.from_checkpoint else "quantized at load")
    if model_config.attention_arch == "mla":
        logger.info("fp8: absorbed w_kc / w_vc in e4m3 with kv_b_proj's row scales (decode dequantizes tiles "
                    "in-kernel; prefill's batched matmuls take %s copies)", str(dtype).removeprefix("torch."))
    return count
