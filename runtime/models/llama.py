"""Llama family: Llama 2/3 (llama3 rope scaling), Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norms),
SmolLM2 (tied embeddings).

The variants differ only in ModelConfig fields (LayerSpec.sliding_window and qk_norm, attention_bias, rope scaling,
tie_word_embeddings): every layer is the pre-norm block of an MHA/GQA attention and a gated MLP.
"""

from __future__ import annotations

from braid.runtime.loader.model_config import LayerSpec
from braid.runtime.models.blocks import (GATE_UP_STACKED_PARAMS, QKV_STACKED_PARAMS, DecoderForCausalLM,
                                         PreNormDecoderLayer, attention_and_mlp)


class LlamaForCausalLM(DecoderForCausalLM):
    stacked_params = QKV_STACKED_PARAMS + GATE_UP_STACKED_PARAMS

    def build_layer(self, layer_id: int, spec: LayerSpec) -> PreNormDecoderLayer:
        c = self.model_config
        return PreNormDecoderLayer(*attention_and_mlp(layer_id, spec, c), c.hidden_size, c.rms_norm_eps)
