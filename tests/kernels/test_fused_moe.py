"""MoE layer: routing == HF DeepseekV2's router (greedy, group-limited), the FusedMoE layer == HF DeepseekV2Moe with
weights loaded from a save_pretrained checkpoint, the fused Triton MoE == the PyTorch reference (under
TRITON_INTERPRET=1 on CPU at tiny shapes; compiled on the GPU at DeepSeek-V2-Lite shapes, marked `gpu`)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

from braid.runtime.layers.moe import FusedMoE, fused_experts, moe_forward_torch, route_expert_weights, select_experts
from braid.runtime.loader.config_specs import MoESpec
from braid.runtime.loader.hf import iter_safetensors
from braid.runtime.loader.model_config import ModelConfig
from braid.runtime.models.base import CausalLM
from braid.runtime.models.blocks import GATE_UP_STACKED_PARAMS, GatedMLP

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

ROUTINGS = {
    "greedy": dict(topk_method="greedy"),
    "group_limited": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
}


def hf_config(routing: str, **overrides) -> DeepseekV2Config:
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, n_routed_experts=16, num_experts_per_tok=4,
                  n_shared_experts=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=8, first_k_dense_replace=1, routed_scaling_factor=2.5, **ROUTINGS[routing])
    fields.update(overrides)
    return DeepseekV2Config(**fields)


def sorted_routing(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # the k experts of a token come unordered: compare them sorted by expert id
    ids_sorted, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_select_experts_matches_hf_router(routing):
    torch.manual_seed(0)
    config = hf_config(routing)
    spec = ModelConfig.from_hf(config.to_dict()).moe
    router = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(37, config.hidden_size)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, spec)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (37, 4)
    got_w, got_ids = sorted_routing(weights, ids)
    ref_w, ref_ids = sorted_routing(hf_weights, hf_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=0, atol=1e-6)
    if routing == "group_limited":
        # every token's experts lie within topk_group (2) of the 4 groups
        assert ((ids.long() // (16 // 4)).sort(dim=-1).values.diff(dim=-1) != 0).sum(dim=-1).max() <= 1


def test_norm_topk_prob_renormalizes_before_scaling():
    torch.manual_seed(1)
    logits = torch.randn(9, 8)
    plain = MoESpec(8, 3, 16)
    normed = MoESpec(8, 3, 16, norm_topk_prob=True, routed_scaling_factor=1.5)
    w_plain, ids_plain = select_experts(logits, plain)
    w_norm, ids_norm = select_experts(logits, normed)
    assert torch.equal(ids_plain, ids_norm)
    torch.testing.assert_close(w_norm, 1.5 * w_plain / w_plain.sum(-1, keepdim=True))


def test_unsupported_routing_and_activation_are_refused():
    spec = MoESpec(8, 2, 16, topk_method="noaux_tc", n_group=2, topk_group=1)
    with pytest.raises(ValueError, match="noaux_tc"):
        select_experts(torch.randn(2, 8), spec)
    with pytest.raises(ValueError, match="noaux_tc"):
        FusedMoE(8, 2, 32, 16, spec)
    with pytest.raises(ValueError, match="activation"):
        FusedMoE(8, 2, 32, 16, MoESpec(8, 2, 16), activation="gelu")
    with pytest.raises(ValueError, match="disagrees"):
        FusedMoE(8, 3, 32, 16, MoESpec(8, 2, 16))


class OneMoELayer(CausalLM):
    """Holds `model.layers.1.mlp` as braid's FusedMoE + shared GatedMLP, loaded the way a model family loads."""

    stacked_params = GATE_UP_STACKED_PARAMS

    def __init__(self, config: ModelConfig):
        super().__init__()
        spec = config.moe
        shared = GatedMLP(config.hidden_size, spec.moe_intermediate_size * spec.n_shared_experts)
        layer = torch.nn.Module()
        layer.mlp = FusedMoE(spec.n_routed_experts, spec.num_experts_per_tok, config.hidden_size,
                             spec.moe_intermediate_size, spec, shared_experts=shared)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module(), layer])


def save_tiny_deepseek(tmp_path, routing: str):
    torch.manual_seed(2)
    config = hf_config(routing)
    hf = DeepseekV2ForCausalLM(config).float().eval()
    for name, p in hf.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, std=0.3 if "gate.weight" in name else 0.1)
    hf.save_pretrained(tmp_path)
    return config, hf


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_fused_moe_layer_loads_checkpoint_and_matches_hf(tmp_path, routing):
    config, hf = save_tiny_deepseek(tmp_path, routing)
    braid_config = ModelConfig.from_hf(config.to_dict())
    with torch.device("meta"):
        holder = OneMoELayer(braid_config)
    layer_names = ((n, t) for n, t in iter_safetensors(str(tmp_path)) if n.startswith("model.layers.1.mlp."))
    holder.load_weights(route_expert_weights(holder, layer_names, "cpu"), "cpu")
    holder.post_load("cpu", torch.float32)
    moe = holder.model.layers[1].mlp
    assert not any(p.is_meta for p in holder.parameters())
    assert moe.gate.weight.dtype == torch.float32
    # the stacked tensors hold HF's experts: w13 = [gate; up] per expert, w2 = down
    hf_experts = hf.model.layers[1].mlp.experts
    assert torch.equal(moe.w13_weight, hf_experts.gate_up_proj.detach())
    assert torch.equal(moe.w2_weight, hf_experts.down_proj.detach())
    hidden = torch.randn(23, config.hidden_size)
    with torch.no_grad():
        ref = hf.model.layers[1].mlp(hidden[None])[0]
        out = moe(hidden)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_partial_expert_checkpoint_is_refused(tmp_path):
    config, _ = save_tiny_deepseek(tmp_path, "greedy")
    with torch.device("meta"):
        holder = OneMoELayer(ModelConfig.from_hf(config.to_dict()))
    names = ((n, t) for n, t in iter_safetensors(str(tmp_path))
             if n.startswith("model.layers.1.mlp.") and ".experts.3.up_proj" not in n)
    holder.load_weights(route_expert_weights(holder, names, "cpu"), "cpu")
    with pytest.raises(ValueError, match=r"\(3, 'up_proj'\)"):
        holder.post_load("cpu", torch.float32)
    with pytest.raises(ValueError, match="not a FusedMoE"):
        list(route_expert_weights(holder, [("model.layers.0.mlp.experts.0.up_proj.weight", torch.zeros(1))], "cpu"))


def random_moe_inputs(tokens, experts, top_k, hidden, inter, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(device, dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(device)
    weights, ids = select_experts(logits, MoESpec(experts, top_k, inter, routed_scaling_factor=1.3))
    return x, w13, w2, weights, ids


def test_torch_reference_matches_dense_loop():
    x, w13, w2, weights, ids = random_moe_inputs(7, 6, 2, 16, 8, torch.float32, "cpu")
    expected = torch.zeros_like(x)
    for t in range(7):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe_forward_torch(x, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-5)
