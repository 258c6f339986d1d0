"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

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
