"""Model loading: resolve the path, read the config, build the model on `meta`, load weights with assign."""

from __future__ import annotations

import logging
import sys
import time

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
    """(name, tensor) pairs of the checkpoint and how many there are, counted from the safetensors headers."""
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
    return iter_safetensors(folder), safetensors_tensor_count(folder)


def load_model(model_config: ModelConfig, server_args, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from tqdm import tqdm

    from braid.runtime.models.registry import get_model_class

    cls = get_model_class(model_config.architecture)
    if model_config.quantization is not None:
        from braid.runtime.layers.quantization import get_linear_method

        get_linear_method(model_config.quantization.method)  # a checkpoint braid cannot multiply fails here, loudly
    logger.info("loading model %s (%s, dtype %s, device %s)", model_config.path or server_args.model_path,
                model_config.architecture, str(dtype).removeprefix("torch."), device)
    started = time.perf_counter()
    with torch.device("meta"):
        model = cls(model_config)
    if server_args.load_format == "dummy":
        from braid.runtime.loader.dummy import materialize_random

        materialize_random(model, device, dtype, seed=server_args.random_seed)
        logger.info("weights: random (--load-format dummy) in %.1f s", time.perf_counter() - started)
    else:
        weights, total = iter_weights(model_config, server_args)
        # a bar only on a terminal: in a log file its carriage-return redraws are noise
        bar = tqdm(weights, total=total, desc="Loading weights", unit="tensor", leave=False,
                   disable=not (sys.stderr.isatty() and logger.isEnabledFor(logging.INFO)))
        loaded = 0
        for_model = ((name, t.to(dtype=dtype if t.is_floating_point() else t.dtype)) for name, t in bar)

        def counted():
            nonlocal loaded
            for item in for_model:
                loaded += 1
                yield item

        model.load_weights(counted(), device)
        bar.close()
        logger.info("weights loaded: %d tensors in %.1f s", loaded, time.perf_counter() - started)
    model.post_load(device, dtype)
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if still_meta:
        raise ValueError(f"weights missing from the checkpoint: {still_meta[:5]}{' ...' if len(still_meta) > 5 else ''}")
    return model.eval()
