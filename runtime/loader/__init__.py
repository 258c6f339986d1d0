"""Model loading: resolve the path, read the config, build the model on `meta`, load weights with assign."""

from __future__ import annotations

import logging

import torch

from braid.runtime.loader.model_config import ModelConfig
from braid.runtime.loader.model_path import is_gguf, resolve_model_path

logger = logging.getLogger(__name__)


def load_model_config(server_args) -> ModelConfig:
    path = resolve_model_path(server_args.model_path) if server_args.load_format != "dummy" or server_args.model_config is None else None
    if path is not None and is_gguf(path):
        from braid.runtime.loader.gguf import gguf_config

        raw = gguf_config(path)
    elif path is not None:
        from braid.runtime.loader.hf import hf_config

        raw = hf_config(path)
    else:
        raw = {}
    overrides = server_args.model_config_overrides()
    if overrides:
        raw = {**raw, **overrides}
    if not raw:
        raise ValueError("load_format='dummy' needs --model-path with a config or --model-config")
    return ModelConfig.from_hf(raw, server_args, path)


def iter_weights(model_config: ModelConfig, server_args):
    fmt = server_args.load_format
    path = model_config.path
    if fmt == "auto":
        fmt = "gguf" if is_gguf(path) else "safetensors"
    if fmt == "gguf":
        from braid.runtime.loader.gguf import iter_gguf_tensors_cached

        return iter_gguf_tensors_cached(path, model_config.hf), model_config.num_tensors_hint
    if fmt == "safetensors":
        from braid.runtime.loader.hf import iter_safetensors

        return iter_safetensors(path), None
    raise ValueError(f"unknown load_format {fmt}")


def load_model(model_config: ModelConfig, server_args, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from tqdm import tqdm

    from braid.runtime.models.registry import get_model_class

    cls = get_model_class(model_config.architecture)
    if model_config.quantization is not None:
        from braid.runtime.layers.quantization import get_linear_method

        get_linear_method(model_config.quantization.method)  # a checkpoint braid cannot multiply fails here, loudly
    with torch.device("meta"):
        model = cls(model_config)
    if server_args.load_format == "dummy":
        from braid.runtime.loader.dummy import materialize_random

        materialize_random(model, device, dtype, seed=server_args.random_seed)
    else:
        weights, total = iter_weights(model_config, server_args)
        bar = tqdm(weights, total=total, desc="Loading weights", unit="tensor", leave=False,
                   disable=not logger.isEnabledFor(logging.INFO))
        model.load_weights(((name, t.to(dtype=dtype if t.is_floating_point() else t.dtype)) for name, t in bar), device)
        bar.close()
    model.post_load(device, dtype)
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if still_meta:
        raise ValueError(f"weights missing from the checkpoint: {still_meta[:5]}{' ...' if len(still_meta) > 5 else ''}")
    return model.eval()
