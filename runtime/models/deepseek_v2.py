"""DeepSeek-V2 family (V2, V2-Lite, Coder-V2): MLA attention (models/mla.py) and a mixture of experts.

Layer i is the shared pre-norm block; its MLP is dense for i < first_k_dense_replace, else a DeepSeekMoE
(layers/moe FusedMoE): a router in fp32 over n_routed_experts (greedy or group-limited top-k, times
routed_scaling_factor), the routed experts plus n_shared_experts always-on experts, all in the same fused launches.
The checkpoint's per-expert tensors `mlp.experts.{e}.{gate,up,down}_proj.weight` and the shared experts'
`mlp.shared_experts.{gate,up,down}_proj.weight` are stacked at load into w13 [E + S, 2I, hidden] and
w2 [E + S, hidden, I] (route_expert_weights).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from braid.runtime.layers.linear import norm_linear_act
from braid.runtime.layers.moe import FusedMoE, route_expert_weights
from braid.runtime.layers.rotary import get_rope
from braid.runtime.loader.model_config import LayerSpec
from braid.runtime.models.blocks import GATE_UP_STACKED_PARAMS, DecoderForCausalLM, GatedMLP, PreNormDecoderLayer
from braid.runtime.models.mla import MLA_STACKED_PARAMS, MLAttention


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    """The pre-norm block; an MoE layer hands its post-attention norm to the MoE, whose fp32 router runs it (one
    launch with the router at decode sizes)."""

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor], fb):
        if isinstance(self.mlp, GatedMLP):
            return super().forward(positions, hidden, residual, fb)
        qkv, residual = norm_linear_act(self.self_attn.qkv_proj, hidden, self.input_layernorm, residual)
        hidden = self.self_attn.attend(positions, qkv, fb)
        return self.mlp.forward_after_norm(hidden, residual, self.post_attention_layernorm)


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    stacked_params = MLA_STACKED_PARAMS + GATE_UP_STACKED_PARAMS

    def build_layer(self, layer_id: int, spec: LayerSpec) -> DeepseekV2DecoderLayer:
        c = self.model_config
        if c.mla is None:
            raise ValueError("DeepseekV2ForCausalLM needs the MLA fields (kv_lora_rank, qk_rope_head_dim, ...)")
        if layer_id == 0:
            # one rope table for every layer (163840 positions x 64 dims in fp32 for DeepSeek-V2)
            r = c.rope
            self.rotary_emb = get_rope(r.rotary_dim, r.rotary_dim, r.max_position, r.theta, r.scaling_dict(),
                                       r.is_neox_style)
        attention = MLAttention(layer_id, spec, c.mla, self.rotary_emb, c.hidden_size, c.rms_norm_eps,
                                absorbed=not c.mla_expanded, bias=c.attention_bias)
        if spec.is_moe:
            m = c.moe
            # the n_shared_experts shared experts are stacked after the routed ones (layers/moe/layer.py)
            mlp = FusedMoE(m.n_routed_experts, m.num_experts_per_tok, c.hidden_size, m.moe_intermediate_size, m,
                           activation=c.hidden_act)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
        return DeepseekV2DecoderLayer(attention, mlp, c.hidden_size, c.rms_norm_eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], device) -> None:
        super().load_weights(route_expert_weights(self, weights, device), device)

    def post_load(self, device, dtype) -> None:
        super().post_load(device, dtype)
        for layer in self.model.layers:
            layer.self_attn.absorb_weights()
