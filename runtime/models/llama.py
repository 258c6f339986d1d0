"""Llama family: Llama 2/3 (llama3 rope scaling), Mistral (sliding window), Qwen2 (qkv bias), SmolLM2 (tied embeddings).

The variants differ only in ModelConfig fields (LayerSpec.sliding_window, attention_bias, rope scaling,
tie_word_embeddings): every layer is the pre-norm block of an MHA/GQA attention and a gated MLP.
"""

from __future__ import annotations

from braid.runtime.loader.model_config import LayerSpec
from braid.runtime.models.blocks import (GATE_UP_STACKED_PARAMS, QKV_STACKED_PARAMS, Attention, DecoderForCausalLM,
                                         GatedMLP, PreNormDecoderLayer)


class LlamaForCausalLM(DecoderForCausalLM):
    stacked_params = QKV_STACKED_PARAMS + GATE_UP_STACKED_PARAMS

    def build_layer(self, layer_id: int, spec: LayerSpec) -> PreNormDecoderLayer:
        c = self.model_config
        attention = Attention(layer_id, spec, c.rope, c.hidden_size, qkv_bias=c.attention_bias,
                              out_bias=c.attention_out_bias)
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
        return PreNormDecoderLayer(attention, mlp, c.hidden_size, c.rms_norm_eps)
