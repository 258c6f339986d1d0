"""Gemma-2: sliding-window attention on the layers config.json's `layer_types` marks (even layers by default, keys
(p - W, p]) and global attention on the rest, `query_pre_attn_scalar` softmax scaling and attention soft-cap (all in
LayerSpec), a final logit soft-cap in the LM head (so sampling and logprobs see capped logits), four (1 + w) RMSNorms
per layer computed in fp32, embeddings times sqrt(hidden) in the weight dtype, a GELU-tanh gated MLP, tied embeddings.

Gemma-3 (text; Gemma3ForCausalLM checkpoints, model_type gemma3_text) is this class too: the same layers with a (1 + w)
RMSNorm on every query and key head before rope, the window layers' own rope theta, five window layers to one global
by default and no soft-caps; all of it in LayerSpec.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from braid.runtime.layers.gemma_kernels import post_norm_add_norm
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.loader.model_config import LayerSpec
from braid.runtime.models.blocks import (GATE_UP_STACKED_PARAMS, QKV_STACKED_PARAMS, Attention, DecoderForCausalLM,
                                         DecoderModel, GatedMLP, attention_and_mlp)


class SandwichNormDecoderLayer(nn.Module):
    """hidden + post_norm(attn(norm(hidden))), then + post_norm(mlp(norm(...))); every norm multiplies by (1 + w).

    Each post-norm, the residual add after it and the pre-norm after that are one kernel (gemma_kernels.py), so a
    layer returns its MLP output before post_feedforward_layernorm: the next layer (or the final norm) applies it
    together with its own input norm.
    """

    def __init__(self, self_attn: Attention, mlp: GatedMLP, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, add_unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, add_unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, add_unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, add_unit_offset=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor], fb,
                pending_norm: Optional[RMSNorm] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden]: the embeddings (residual None) or the previous layer's MLP output, which
        `pending_norm` (its post_feedforward_layernorm) norms before the add. -> (this layer's MLP output, not yet
        post-normed; the residual stream)."""
        if residual is None:
            x, residual = self.input_layernorm(hidden), hidden
        else:
            x, residual = post_norm_add_norm(hidden, residual, pending_norm, self.input_layernorm)
        attn = self.self_attn(positions, x, fb)
        x, residual = post_norm_add_norm(attn, residual, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return self.mlp(x), residual


class SandwichNormDecoderModel(DecoderModel):
    """DecoderModel whose layers hand their last post-norm on to the next layer's input norm (and the final norm)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb,
                input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual, pending_norm = None, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb, pending_norm)
            pending_norm = layer.post_feedforward_layernorm
        hidden, _ = post_norm_add_norm(hidden, residual, pending_norm, self.norm)
        return hidden


class Gemma2ForCausalLM(DecoderForCausalLM):
    stacked_params = QKV_STACKED_PARAMS + GATE_UP_STACKED_PARAMS
    scale_embeddings = True
    norm_unit_offset = True
    decoder_model = SandwichNormDecoderModel

    def build_layer(self, layer_id: int, spec: LayerSpec) -> SandwichNormDecoderLayer:
        c = self.model_config
        return SandwichNormDecoderLayer(*attention_and_mlp(layer_id, spec, c, self.norm_unit_offset), c.hidden_size,
                                        c.rms_norm_eps)
