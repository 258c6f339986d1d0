"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("braid.runtime.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("braid.runtime.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("braid.runtime.models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture} is not supported; supported: {', '.join(supported_architectures())}")
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)
