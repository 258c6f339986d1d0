"""Reading a model's description: resolve the path, read its config (HF folder or GGUF), and the checkpoint files'
tensors. Building a model and filling its layers with weights is model_executor.model_loader."""

from __future__ import annotations

from braid.runtime.loader.model_config import ModelConfig
from braid.runtime.loader.model_path import is_gguf, resolve_model_path


def load_model_config(server_args) -> ModelConfig:
    path = resolve_model_path(server_args.model_path) if server_args.load_format != "dummy" or server_args.model_config is None else None
    raw, generation = {}, {}
    if path is not None and is_gguf(path):
        from braid.runtime.loader.gguf import gguf_config

        raw = gguf_config(path)
    elif path is not None:
        from braid.runtime.loader.hf import hf_config, hf_generation_config

        raw, generation = hf_config(path), hf_generation_config(path)
    overrides = server_args.model_config_overrides()
    if overrides:
        raw = {**raw, **overrides}
    if not raw:
        raise ValueError("load_format='dummy' needs --model-path with a config or --model-config")
    return ModelConfig.from_hf(raw, server_args, path, generation_config=generation)
