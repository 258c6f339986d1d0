"""Shared model blocks against HF transformers' modules with the same weights (no checkpoint is loaded)."""

import pytest
import torch
import transformers

from braid.runtime.loader.model_config import LayerSpec, RopeSpec
from braid.runtime.models.blocks import Attention, GatedMLP


@pytest.mark.parametrize("hidden_act, hf_config", [
    ("silu", transformers.LlamaConfig(hidden_size=32, intermediate_size=48)),
    ("gelu_tanh", transformers.Gemma2Config(hidden_size=32, intermediate_size=48)),
])
def test_gated_mlp_matches_hf(hidden_act, hf_config):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    hf = (LlamaMLP if hidden_act == "silu" else Gemma2MLP)(hf_config).eval()
    mlp = GatedMLP(32, 48, hidden_act)
    mlp.gate_up_proj.weight.data = torch.cat([hf.gate_proj.weight, hf.up_proj.weight]).detach().clone()
    mlp.down_proj.weight.data = hf.down_proj.weight.detach().clone()
    x = torch.randn(5, 32)
    with torch.no_grad():
        assert torch.allclose(mlp(x), hf(x), atol=1e-5)


def test_attention_block_refuses_mla_layers():
    spec = LayerSpec("mla", 4, 4, 24, 16, 24 ** -0.5)
    with pytest.raises(ValueError, match="'mla'"):
        Attention(0, spec, RopeSpec(theta=10000.0, rotary_dim=8, max_position=64), hidden_size=64)


def test_attention_block_shapes_from_layer_spec():
    spec = LayerSpec("mha", 4, 2, 16, 16, 0.1, sliding_window=8, logit_cap=30.0)
    with torch.device("meta"):
        attn = Attention(3, spec, RopeSpec(theta=10000.0, rotary_dim=16, max_position=64), 64, qkv_bias=True)
    assert attn.qkv_proj.weight.shape == (4 * 16 + 2 * 2 * 16, 64) and attn.qkv_proj.bias is not None
    assert attn.o_proj.bias is None
    ra = attn.attn
    assert (ra.layer_id, ra.num_heads, ra.num_kv_heads, ra.scaling, ra.sliding_window, ra.logit_cap) == (3, 4, 2, 0.1, 8, 30.0)
