"""Model loading: build the model on `meta`, load the checkpoint's weights into its layers with assign (this rank's
slices under tensor parallelism), quantize where asked."""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

import torch

from braid.runtime.dtypes import COMPUTE_DTYPES
from braid.runtime.loader.model_config import ModelConfig
from braid.runtime.loader.model_path import is_gguf

logger = logging.getLogger(__name__)


def _tensor_parallel_range(model: torch.nn.Module):
    """(name, shape) -> (dim, start, stop) of this TP rank's part of a checkpoint tensor, asked of the module that
    will hold it (its `rank_range`); None for tensors every rank keeps whole."""

    from braid.runtime.layers.moe.layer import EXPERT_WEIGHT_NAME

    def rank_range(name: str, shape: list[int]):
        expert = EXPERT_WEIGHT_NAME.match(name)
        if expert is not None:  # a FusedMoE's per-expert matrix: the rank's slice of its intermediate dim
            try:
                ask = getattr(model.get_submodule(expert["layer"]), "expert_rank_range", None)
            except AttributeError:
                return None
            return ask(expert["proj"], shape) if ask is not None else None
        target, shard_id = model.fused_name(name)
        module_path, _, attr = target.rpartition(".")
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            return None  # load_weights names the tensor that has no place
        ask = getattr(module, "rank_range", None)
        return ask(attr, shard_id, shape) if ask is not None else None

    return rank_range


_TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Gemma2ForCausalLM", "Gemma3ForCausalLM", "DeepseekV2ForCausalLM",
                                  "LlavaOnevisionForConditionalGeneration")


def check_tensor_parallel_support(model_config: ModelConfig, tp_size: int) -> None:
    """Families whose layers are not split over ranks yet are refused before anything is loaded."""
    if tp_size > 1 and model_config.architecture not in _TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(f"tp_size={tp_size}: {model_config.architecture} is not split over tensor-parallel ranks "
                         f"yet (supported: {', '.join(_TENSOR_PARALLEL_ARCHITECTURES)}); run it with --tp-size 1 "
                         "(and --dp-size N for more throughput)")


def iter_weights(model_config: ModelConfig, server_args, model: Optional[torch.nn.Module] = None):
    """(name, tensor) pairs of the checkpoint and how many there are, counted from the safetensors headers. Under
    tensor parallelism (with `model`), each tensor the model splits is read as this rank's slice only."""
    fmt = server_args.load_format
    path = model_config.path
    if fmt == "auto":
        fmt = "gguf" if is_gguf(path) else "safetensors"
    from braid.runtime.loader.hf import iter_safetensors, safetensors_tensor_count

    if fmt == "gguf":
        from braid.runtime.loader.gguf import gguf_dequantized_dir

        folder = gguf_dequantized_dir(path, model_config.hf)
    elif fmt == "safetensors":
        folder = path
    else:
        raise ValueError(f"unknown load_format {fmt}")
    if model is not None and server_args.tp_size > 1:
        from braid.runtime.loader.hf import iter_safetensors_rank_slices

        return iter_safetensors_rank_slices(folder, _tensor_parallel_range(model)), safetensors_tensor_count(folder)
    return iter_safetensors(folder), safetensors_tensor_count(folder)


def linear_quantization(model_config: ModelConfig, server_args) -> Optional[str]:
    """How the linear layers store their weights: --quantization, else the checkpoint's quantization_config (None:
    dense). Raises for a method braid does not have or a flag that contradicts the checkpoint."""
    from braid.runtime.layers.quantization import get_linear_method

    checkpoint = model_config.quantization.method if model_config.quantization is not None else None
    requested = getattr(server_args, "quantization", None)
    if checkpoint is not None:
        get_linear_method(checkpoint)  # a checkpoint braid cannot multiply fails here, loudly
        if requested is not None and requested != checkpoint:
            raise ValueError(f"--quantization {requested} contradicts the checkpoint, which is quantized as "
                             f"{checkpoint!r}")
        if server_args.load_format == "dummy":
            raise ValueError(f"--load-format dummy with a config quantized as {checkpoint!r}: random weights are "
                             "dense; drop quantization_config and pass --quantization instead")
    method = requested or checkpoint
    if method is not None:
        get_linear_method(method)
    return method


def _kv_cache_scales(found: dict, num_layers: int, kv_cache_dtype: str) -> Optional[tuple[list, list]]:
    """The checkpoint's per-layer (k_scales, v_scales) for an fp8_e4m3 cache (1.0 where a layer has none); None
    when it has none or the cache is not e4m3, which stores KV unscaled."""
    if not found:
        return None
    if kv_cache_dtype not in ("fp8_e4m3", "fp8_e4m3fn"):
        logger.info("the checkpoint has KV-cache scales for %d layers; they apply to --kv-cache-dtype fp8_e4m3 only",
                    len({layer for layer, _ in found}))
        return None
    missing = sorted({layer for layer in range(num_layers) for kind in "kv" if (layer, kind) not in found})
    if missing:
        logger.info("KV-cache scales: layers %s have none in the checkpoint and keep 1.0", missing)
    return ([found.get((layer, "k"), 1.0) for layer in range(num_layers)],
            [found.get((layer, "v"), 1.0) for layer in range(num_layers)])


def load_model(model_config: ModelConfig, server_args, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from tqdm import tqdm

    from braid.runtime.models.registry import get_model_class

    cls = get_model_class(model_config.architecture)
    check_tensor_parallel_support(model_config, server_args.tp_size)
    quantization = linear_quantization(model_config, server_args)
    logger.info("loading model %s (%s, dtype %s, device %s)", model_config.path or server_args.model_path,
                model_config.architecture, str(dtype).removeprefix("torch."), device)
    started = time.perf_counter()
    with torch.device("meta"):
        model = cls(model_config)
    kv_scales: dict = {}
    if quantization == "fp8":
        from braid.runtime.model_executor.fp8_layers import use_fp8_linears

        use_fp8_linears(model, model_config, device, dtype)
    if server_args.load_format == "dummy":
        from braid.runtime.loader.dummy import materialize_random

        materialize_random(model, device, dtype, seed=server_args.random_seed)
        logger.info("weights: random (--load-format dummy) in %.1f s", time.perf_counter() - started)
    else:
        weights, total = iter_weights(model_config, server_args, model)
        # a bar only on a terminal: in a log file its carriage-return redraws are noise
        bar = tqdm(weights, total=total, desc="Loading weights", unit="tensor", leave=False,
                   disable=not (sys.stderr.isatty() and logger.isEnabledFor(logging.INFO)))
        loaded = 0
        # a quantized checkpoint's fp8 weights and fp32 scales keep their dtypes
        keep = model_config.quantization is not None
        for_model = ((name, t if keep and (t.dtype not in COMPUTE_DTYPES or name.endswith("_scale")) else
                      t.to(dtype=dtype if t.is_floating_point() else t.dtype)) for name, t in bar)
        if keep:
            from braid.runtime.layers.quantization.fp8 import split_kv_cache_scales

            for_model = split_kv_cache_scales(for_model, model_config.num_layers, kv_scales)
            if model_config.moe is not None and server_args.tp_size > 1:
                # the sharded reader slices expert rows by shape; their scale tensors it would read whole
                raise ValueError("FP8 MoE checkpoints with --tp-size > 1 are not supported yet; use --tp-size 1, or "
                                 "a bf16 checkpoint with --quantization fp8")

        def counted():
            nonlocal loaded
            for item in for_model:
                loaded += 1
                yield item

        model.load_weights(counted(), device)
        bar.close()
        logger.info("weights loaded: %d tensors in %.1f s", loaded, time.perf_counter() - started)
    model.post_load(device, dtype)
    model.kv_cache_scales = _kv_cache_scales(kv_scales, model_config.num_layers, server_args.kv_cache_dtype)
    if quantization is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # the dense copies quantized away: the KV pool is sized from free memory next
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if still_meta:
        raise ValueError(f"weights missing from the checkpoint: {still_meta[:5]}{' ...' if len(still_meta) > 5 else ''}")
    return model.eval()
