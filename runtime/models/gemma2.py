"""Gemma-2: sliding-window attention on the layers config.json's `layer_types` marks (even layers by default, keys
(p - W, p]) and global attention on the rest, `query_pre_attn_scalar` softmax scaling and attention soft-cap (all in
LayerSpec), a final logit soft-cap in the LM head (so sampling and logprobs see capped logits), four (1 + w) RMSNorms
per layer computed in fp32, embeddings times sqrt(hidden) in the weight dtype, a GELU-tanh gated MLP, tied embeddings.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from braid.runtime.layers.linear import norm_linear_act
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.loader.model_config import LayerSpec
from braid.runtime.models.blocks import (GATE_UP_STACKED_PARAMS, QKV_STACKED_PARAMS, Attention, DecoderForCausalLM,
                                         GatedMLP, attention_and_mlp)


class SandwichNormDecoderLayer(nn.Module):
    """hidden + post_norm(attn(norm(hidden))), then + post_norm(mlp(norm(...))); every norm multiplies by (1 + w).

    Like PreNormDecoderLayer, the residual sum travels into the next pre-norm (fused add); the post-norms have none.
    """

    def __init__(self, self_attn: Attention, mlp: GatedMLP, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, add_unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, add_unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, add_unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, add_unit_offset=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor], fb):
        qkv, residual = norm_linear_act(self.self_attn.qkv_proj, hidden, self.input_layernorm, residual)
        hidden = self.post_attention_layernorm(self.self_attn.attend(positions, qkv, fb))
        hidden, residual = norm_linear_act(self.mlp.gate_up_proj, hidden, self.pre_feedforward_layernorm, residual,
                                           self.mlp.act)
        return self.post_feedforward_layernorm(self.mlp.down_proj(hidden)), residual


class Gemma2ForCausalLM(DecoderForCausalLM):
    stacked_params = QKV_STACKED_PARAMS + GATE_UP_STACKED_PARAMS
    scale_embeddings = True
    norm_unit_offset = True

    def build_layer(self, layer_id: int, spec: LayerSpec) -> SandwichNormDecoderLayer:
        c = self.model_config
        return SandwichNormDecoderLayer(*attention_and_mlp(layer_id, spec, c), c.hidden_size, c.rms_norm_eps)
