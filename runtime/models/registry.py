"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily."""

from __future__ import annotations

import importlib
import json
import os

from braid.runtime.loader.model_path import resolve_model_path

_MODELS = {
    "LlamaForCausalLM": ("braid.runtime.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("braid.runtime.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("braid.runtime.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("braid.runtime.models.llama", "LlamaForCausalLM"),
    "DeepseekV2ForCausalLM": ("braid.runtime.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "LlavaOnevisionForConditionalGeneration": ("braid.runtime.models.llava_onevision",
                                               "LlavaOnevisionForConditionalGeneration"),
    "Gemma2ForCausalLM": ("braid.runtime.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("braid.runtime.models.gemma2", "Gemma2ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture} is not supported by braid; supported: "
                         f"{', '.join(supported_architectures())}")


def get_model_class(architecture: str):
    check_architecture(architecture)
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)


def check_model_source(server_args) -> None:
    """Fail in one line before any process starts: a missing model path, or a config.json whose architecture
    braid does not implement (the scheduler would find out only after starting up)."""
    overrides = server_args.model_config_overrides() or {}
    if server_args.load_format == "dummy" and overrides:
        architectures = overrides.get("architectures")
    else:
        path = resolve_model_path(server_args.model_path)
        architectures = overrides.get("architectures")
        config_file = os.path.join(path, "config.json")
        if architectures is None and os.path.isfile(config_file):
            with open(config_file) as f:
                architectures = json.load(f).get("architectures")
    if architectures:
        check_architecture(architectures[0])
