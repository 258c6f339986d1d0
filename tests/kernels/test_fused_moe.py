"""MoE layer: routing == HF DeepseekV2's router (greedy, group-limited), the FusedMoE layer == HF DeepseekV2Moe with
weights loaded from a save_pretrained checkpoint, the fused Triton MoE == the PyTorch reference (under
TRITON_INTERPRET=1 on CPU at tiny shapes; compiled on the GPU at DeepSeek-V2-Lite shapes, marked `gpu`).
transformers is imported inside the HF-parity tests only, so that the kernel tests run on an image with another
transformers version."""

from __future__ import annotations

import pytest
import torch

from braid.runtime.layers.moe import FusedMoE, fused_experts, moe_forward_torch, route_expert_weights, select_experts
from braid.runtime.layers.moe.router import select_experts_torch
from braid.runtime.layers.moe.router_kernels import route_topk_triton
from braid.runtime.layers.moe.fused_moe_kernels import (MoEKernelConfig, fused_moe_triton, moe_align_block_size,
                                                        pick_config)
from braid.runtime.layers.moe.small_batch_kernels import GemvConfig, small_batch_moe
from braid.runtime.loader.config_specs import MoESpec
from braid.runtime.loader.hf import iter_safetensors
from braid.runtime.loader.model_config import ModelConfig
from braid.runtime.models.base import CausalLM
from braid.runtime.models.blocks import GATE_UP_STACKED_PARAMS, GatedMLP

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # the tiny fused cases run compiled on a GPU, interpreted without one

ROUTINGS = {
    "greedy": dict(topk_method="greedy"),
    "group_limited": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
}


def hf_config(routing: str, **overrides):
    from transformers import DeepseekV2Config

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
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

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


ROUTER_SPECS = {
    "greedy_e64_top6": MoESpec(64, 6, 8),
    # 12 experts (not a power of two) in 3 groups, renormalized and scaled
    "group_e12_renorm": MoESpec(12, 3, 8, topk_method="group_limited_greedy", n_group=3, topk_group=2,
                                norm_topk_prob=True, routed_scaling_factor=2.0),
    "group_e160_v2": MoESpec(160, 6, 8, topk_method="group_limited_greedy", n_group=8, topk_group=3,
                             routed_scaling_factor=16.0),
}


@pytest.mark.parametrize("name", sorted(ROUTER_SPECS))
def test_triton_router_matches_torch_router(name):
    spec = ROUTER_SPECS[name]
    logits = torch.randn(37, spec.n_routed_experts, generator=torch.Generator().manual_seed(4)) * 2
    weights, ids = route_topk_triton(logits.to(DEVICE), spec)
    ref_weights, ref_ids = select_experts_torch(logits, spec)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    got_w, got_ids = sorted_routing(weights.cpu(), ids.cpu())
    want_w, want_ids = sorted_routing(ref_weights, ref_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,tokens", [("greedy_e64_top6", 1), ("group_e12_renorm", 5)])
def test_one_launch_router_matches_gemm_and_torch_router(name, tokens):
    """The small-batch router (the fp32 gate matmul, the selection and 2 shared slots in one launch; its last program
    routes every token) == hidden.float() @ gate.T then the PyTorch router; twice, so the arrival counter reset."""
    from braid.runtime.layers.moe.router_kernels import route_tokens_small_batch

    spec = ROUTER_SPECS[name]
    gen = torch.Generator().manual_seed(tokens)
    # H 200: not a multiple of the column block, so the K mask is exercised
    hidden = torch.randn(tokens, 200, generator=gen).to(torch.bfloat16)
    gate = torch.randn(spec.n_routed_experts, 200, generator=gen) * 0.2
    want_w, want_ids = select_experts_torch(hidden.float() @ gate.T, spec, num_shared=2)
    for _ in range(2):
        weights, ids = route_tokens_small_batch(hidden.to(DEVICE), gate.to(DEVICE), spec, num_shared=2)
        assert weights.shape == ids.shape == (tokens, spec.num_experts_per_tok + 2)
        k = spec.num_experts_per_tok
        got_w, got_ids = sorted_routing(weights[:, :k].cpu(), ids[:, :k].cpu())
        ref_w, ref_ids = sorted_routing(want_w[:, :k], want_ids[:, :k])
        assert torch.equal(got_ids, ref_ids)
        torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)
        # the shared slots: experts E and E + 1, weight 1
        assert ids[:, k:].cpu().tolist() == [[spec.n_routed_experts, spec.n_routed_experts + 1]] * tokens
        assert torch.equal(weights[:, k:].cpu(), torch.ones(tokens, 2))
    with pytest.raises(ValueError, match="up to 16 tokens"):
        route_tokens_small_batch(torch.zeros(17, 200), gate, spec)


def test_one_launch_router_with_the_add_rmsnorm_before_it():
    """route_tokens_small_batch with residual and norm weight == RMSNorm(hidden + residual) (the CPU reference),
    then the PyTorch router on the normed rows; the normed rows and the residual sum come back too."""
    from braid.runtime.layers.moe.router_kernels import route_tokens_small_batch
    from braid.runtime.layers.norm import RMSNorm

    spec = ROUTER_SPECS["group_e12_renorm"]
    gen = torch.Generator().manual_seed(7)
    hidden, residual = (torch.randn(3, 200, generator=gen).to(torch.bfloat16) for _ in range(2))
    norm = RMSNorm(200, 1e-6)
    norm.weight.data = torch.rand(200, generator=gen) + 0.5
    gate = torch.randn(spec.n_routed_experts, 200, generator=gen) * 0.2
    want_normed, want_residual = norm.forward_native(hidden, residual)
    weights, ids, normed, residual_out = (t.cpu() for t in route_tokens_small_batch(
        hidden.to(DEVICE), gate.to(DEVICE), spec, 1, residual=residual.to(DEVICE), norm_weight=norm.weight.to(DEVICE),
        eps=1e-6))
    # the routing of the rows the kernel normed (a last-bit difference in them moves the weights by ~1e-2)
    want_w, want_ids = select_experts_torch(normed.float() @ gate.T, spec, num_shared=1)
    # fp32 math rounded once to bf16 in both; the last bit may differ (fused multiply-adds; the interpreter's bf16
    # rounding)
    torch.testing.assert_close(residual_out, want_residual, atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(normed, want_normed, atol=1e-2, rtol=2 ** -7)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    torch.testing.assert_close(sorted_routing(weights, ids)[0], sorted_routing(want_w, want_ids)[0], rtol=1e-4,
                               atol=1e-5)


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
    """Holds `model.layers.1.mlp` as braid's FusedMoE (shared experts stacked in), loaded the way a model family
    loads."""

    stacked_params = GATE_UP_STACKED_PARAMS

    def __init__(self, config: ModelConfig):
        super().__init__()
        spec = config.moe
        layer = torch.nn.Module()
        layer.mlp = FusedMoE(spec.n_routed_experts, spec.num_experts_per_tok, config.hidden_size,
                             spec.moe_intermediate_size, spec)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module(), layer])


def save_tiny_deepseek(tmp_path, routing: str):
    from transformers import DeepseekV2ForCausalLM

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
    # the stacked tensors hold HF's experts: w13 = [gate; up] per expert, w2 = down; then the 2 shared experts,
    # each 16 of the shared MLP's 32 intermediate units
    hf_experts = hf.model.layers[1].mlp.experts
    assert moe.w13_weight.shape == (16 + 2, 2 * 16, 32) and moe.w2_weight.shape == (16 + 2, 32, 16)
    assert torch.equal(moe.w13_weight[:16], hf_experts.gate_up_proj.detach())
    assert torch.equal(moe.w2_weight[:16], hf_experts.down_proj.detach())
    hf_shared = hf.model.layers[1].mlp.shared_experts
    for s in range(2):
        units = slice(16 * s, 16 * (s + 1))
        assert torch.equal(moe.w13_weight[16 + s], torch.cat([hf_shared.gate_proj.weight[units],
                                                              hf_shared.up_proj.weight[units]]))
        assert torch.equal(moe.w2_weight[16 + s], hf_shared.down_proj.weight[:, units])
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


def test_tensor_parallel_ranks_load_intermediate_slices_that_sum_to_the_whole(tmp_path, monkeypatch):
    from braid.runtime.distributed import parallel_state as ps

    config, hf = save_tiny_deepseek(tmp_path, "greedy")
    spec = ModelConfig.from_hf(config.to_dict()).moe
    checkpoint = [(n.removeprefix("model.layers.1.mlp."), t) for n, t in iter_safetensors(str(tmp_path))
                  if n.startswith("model.layers.1.mlp.") and "experts." in n]
    hidden = torch.randn(5, config.hidden_size)
    weights, ids = select_experts(torch.randn(5, spec.n_routed_experts), spec, num_shared=2)
    partial_sums = torch.zeros_like(hidden)
    for rank in range(2):
        monkeypatch.setattr(ps, "_TP_SIZE", 2)
        monkeypatch.setattr(ps, "_TP_RANK", rank)
        with torch.device("meta"):
            moe = FusedMoE(spec.n_routed_experts, spec.num_experts_per_tok, config.hidden_size,
                           spec.moe_intermediate_size, spec)
        for name, tensor in checkpoint:
            if name.startswith("shared_experts."):
                moe.shared_weight_loader(name.split(".")[1], tensor, "cpu")
            else:
                _, expert, proj, _ = name.split(".")
                moe.weight_loader(proj, int(expert), tensor, "cpu")
        moe.prepack_weights()  # every (expert, proj) slice arrived, the 2 shared experts' too
        assert moe.w13_weight.shape == (18, 16, 32) and moe.w2_weight.shape == (18, 32, 8)
        partial_sums += moe_forward_torch(hidden, moe.w13_weight, moe.w2_weight, weights, ids)
    mlp = hf.model.layers[1].mlp
    routed = moe_forward_torch(hidden, mlp.experts.gate_up_proj.detach(), mlp.experts.down_proj.detach(),
                               weights[:, :4].contiguous(), ids[:, :4].contiguous())
    with torch.no_grad():
        full = routed + mlp.shared_experts(hidden)
    torch.testing.assert_close(partial_sums, full, rtol=1e-5, atol=1e-5)


def test_moe_spec_refuses_top_k_beyond_the_kept_groups():
    with pytest.raises(ValueError, match="cannot come from"):
        MoESpec(16, 9, 32, topk_method="group_limited_greedy", n_group=4, topk_group=2)


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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and torch.isfinite(out.float()).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def fp32_reference(x, w13, w2, weights, ids):
    return moe_forward_torch(x.float(), w13.float(), w2.float(), weights, ids)


def assert_close_to_fp32_reference(out, x, w13, w2, weights, ids):
    ref = fp32_reference(x, w13, w2, weights, ids)
    if x.dtype == torch.float32:
        assert rel_err(out, ref) < 1e-5
    else:
        # bf16 rounds the intermediate rows; the PyTorch path in bf16 is no closer to the fp32 reference
        torch_err = rel_err(moe_forward_torch(x, w13, w2, weights, ids), ref)
        assert rel_err(out, ref) < max(1e-2, 1.5 * torch_err)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens", [11, 97], ids=["placed_by_one_program", "placed_by_atomics"])
def test_moe_align_block_size_groups_and_pads_pairs(block_m, tokens):
    gen = torch.Generator().manual_seed(3)
    # 6 experts (not a power of two), one never chosen; 11 * 3 pairs fit the counting program, 97 * 3 do not
    num_experts, top_k = 6, 3
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(tokens)]).int()
    sorted_pairs, block_experts, padded_total = (t.cpu() for t in moe_align_block_size(ids.to(DEVICE), block_m,
                                                                                          num_experts))
    num_pairs = tokens * top_k
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts)
    assert sorted_pairs.numel() == num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    padded_counts = (counts + block_m - 1) // block_m * block_m
    assert int(padded_total) == int(padded_counts.sum())
    # the used rows: each expert's pairs (ascending when one program placed them), then padding (= num_pairs) up to
    # its padded end; one expert per block
    start, expected_blocks = 0, []
    for expert in range(num_experts):
        pairs = (ids.flatten() == expert).nonzero().flatten().tolist()
        run = sorted_pairs[start:start + int(padded_counts[expert])].tolist()
        got_pairs = run[:len(pairs)] if num_pairs <= 128 else sorted(run[:len(pairs)])
        assert got_pairs == pairs and run[len(pairs):] == [num_pairs] * (len(run) - len(pairs))
        start += int(padded_counts[expert])
        expected_blocks += [expert] * (int(padded_counts[expert]) // block_m)
    assert block_experts[:len(expected_blocks)].tolist() == expected_blocks


TINY_CONFIGS = [MoEKernelConfig(16, 16, 32, 1, 4, 1), MoEKernelConfig(32, 32, 16, 4, 4, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 50])  # 50 * 3 pairs: the two-launch expert sort
@pytest.mark.parametrize("config", TINY_CONFIGS, ids=["bm16", "bm32_group4"])
def test_fused_triton_matches_torch(dtype, tokens, config):
    # H 48 and I 40 are not multiples of the blocks: the column and K masks are exercised
    x, w13, w2, weights, ids = random_moe_inputs(tokens, 8, 3, 48, 40, dtype, DEVICE, seed=tokens)
    out = fused_moe_triton(x, w13, w2, weights, ids, config=config)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to_fp32_reference(out, x, w13, w2, weights, ids)


CUSTOM_GEMV = (GemvConfig(4, 16, 1, 1), GemvConfig(8, 64, 1, 1))


@pytest.mark.parametrize("tokens,dtype,configs", [(1, torch.bfloat16, None), (3, torch.float32, CUSTOM_GEMV),
                                                  (6, torch.bfloat16, CUSTOM_GEMV)],
                         ids=["t1_bf16", "t3_fp32_bn4_bk16_then_bn8_bk64", "t6_bf16_bn4_bk16_then_bn8_bk64"])
def test_small_batch_moe_matches_torch(tokens, dtype, configs):
    """The decode path's two GEMV-style launches (gate_up + SiLU-and-mul per (token, slot) pair; down with the slot
    weights and the sum over slots in its epilogue) == the PyTorch reference; 3 routed + 2 shared slots, and tokens
    that share experts (8 experts: T = 6 repeats some)."""
    x, w13, w2, weights, ids = random_moe_inputs(tokens, 8, 3, 48, 40, dtype, DEVICE, seed=tokens + 10)
    spec = MoESpec(8, 3, 40, routed_scaling_factor=1.3, n_shared_experts=2)
    # 2 more stacked experts for the shared slots
    gen = torch.Generator().manual_seed(tokens)
    w13 = torch.cat([w13, (torch.randn(2, 80, 48, generator=gen) / 48 ** 0.5).to(DEVICE, dtype)])
    w2 = torch.cat([w2, (torch.randn(2, 48, 40, generator=gen) / 40 ** 0.5).to(DEVICE, dtype)])
    weights, ids = select_experts(torch.randn(tokens, 8, generator=gen).to(DEVICE), spec, num_shared=2)
    gate_up, down = configs or (None, None)
    out = small_batch_moe(x, w13, w2, weights, ids, gate_up_config=gate_up, down_config=down)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to_fp32_reference(out, x, w13, w2, weights, ids)


def _e4m3_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, K] -> (e4m3, fp32 scales [E, rows]), one scale per row."""
    scale = w.float().abs().amax(-1).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (w.float() / scale[..., None]).to(torch.float8_e4m3fn), scale.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 50])  # the two-GEMV decode path (on CUDA) and the grouped GEMM
def test_fp8_experts_equal_their_dequantized_copies(dtype, tokens):
    """e4m3 experts with per-row scales: the grouped GEMM, the small-batch GEMVs and the PyTorch path compute what the
    dequantized experts give (the tiles upcast in-kernel, the scales applied to each output row)."""
    x, w13, w2, weights, ids = random_moe_inputs(tokens, 8, 3, 48, 40, dtype, DEVICE, seed=tokens + 20)
    (q13, s13), (q2, s2) = _e4m3_experts(w13), _e4m3_experts(w2)
    dense13 = (q13.float() * s13[..., None]).to(dtype)
    dense2 = (q2.float() * s2[..., None]).to(dtype)
    ref = fp32_reference(x, dense13, dense2, weights, ids)
    outs = {"grouped": fused_moe_triton(x, q13, q2, weights, ids, config=TINY_CONFIGS[0], w13_scale=s13, w2_scale=s2),
            "torch": moe_forward_torch(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)}
    if tokens <= 8:
        outs["small_batch"] = small_batch_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    for name, out in outs.items():
        assert out.dtype == dtype and out.shape == x.shape, name
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), name
    with pytest.raises(ValueError, match="scales of both"):
        moe_forward_torch(x, q13, q2, weights, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="per-row scales"):
        fused_moe_triton(x, q13, q2, weights, ids, w13_scale=s13[:, :3].contiguous(), w2_scale=s2)


def test_fused_experts_dispatch_and_config_table():
    x, w13, w2, weights, ids = random_moe_inputs(3, 4, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        fused_experts(x, w13, w2, weights, ids, config=TINY_CONFIGS[0])
    with pytest.raises(ValueError, match="share a dtype"):
        fused_moe_triton(x.double(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="power of two"):
        MoEKernelConfig(24, 64, 64)
    # small batches take small row blocks, large ones larger (DeepSeek-V2-Lite: 64 experts, top-6)
    block_ms = [pick_config(t, 6, 64).block_m for t in (1, 8, 64, 256, 1024, 8192)]
    assert block_ms == sorted(block_ms) and block_ms[0] == 16


# ------------------------------------------------------------------------- GPU: DeepSeek-V2-Lite shapes

LITE = dict(experts=64, top_k=6, hidden=2048, inter=1408)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 256, 1024])
def test_fused_matches_torch_at_v2_lite_shapes_gpu(tokens):
    """fused_experts (the small-batch GEMVs up to 8 tokens, the grouped GEMM above) and the grouped GEMM forced at
    every T, == the fp32 reference."""
    x, w13, w2, weights, ids = random_moe_inputs(tokens, LITE["experts"], LITE["top_k"], LITE["hidden"],
                                                 LITE["inter"], torch.bfloat16, "cuda", seed=tokens)
    ref = fp32_reference(x, w13, w2, weights, ids)
    torch_err = rel_err(moe_forward_torch(x, w13, w2, weights, ids), ref)
    for out in (fused_experts(x, w13, w2, weights, ids),
                fused_experts(x, w13, w2, weights, ids, config=pick_config(tokens, LITE["top_k"], LITE["experts"]))):
        assert rel_err(out, ref) < max(1e-2, 1.5 * torch_err)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 1024])
def test_fp8_experts_at_v2_lite_shapes_gpu(tokens):
    """e4m3 experts with row scales at V2-Lite shapes on CUDA (the small-batch GEMVs, the grouped GEMM at its tuned
    configs, the PyTorch path) == the fp32 reference on the dequantized experts."""
    x, w13, w2, weights, ids = random_moe_inputs(tokens, LITE["experts"], LITE["top_k"], LITE["hidden"],
                                                 LITE["inter"], torch.bfloat16, "cuda", seed=tokens)
    (q13, s13), (q2, s2) = _e4m3_experts(w13), _e4m3_experts(w2)
    ref = fp32_reference(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids)
    scales = dict(w13_scale=s13, w2_scale=s2)
    for out in (fused_experts(x, q13, q2, weights, ids, **scales),
                fused_experts(x, q13, q2, weights, ids, config=pick_config(tokens, LITE["top_k"], LITE["experts"]),
                              **scales),
                moe_forward_torch(x, q13, q2, weights, ids, **scales)):
        assert rel_err(out, ref) < 1e-2


def v2_lite_moe_layer(seed: int = 0) -> FusedMoE:
    """A V2-Lite MoE layer (64 routed experts top-6 + 2 shared, H 2048, I 1408) with random bf16 weights on CUDA."""
    spec = MoESpec(LITE["experts"], LITE["top_k"], LITE["inter"], n_shared_experts=2)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.device("cuda"):
        layer = FusedMoE(LITE["experts"], LITE["top_k"], LITE["hidden"], LITE["inter"], spec)
    for name, p in list(layer.named_parameters()):
        module, _, attr = f"{name}".rpartition(".")
        scale = p.shape[-1] ** -0.5
        value = (torch.randn(p.shape, device="cuda", generator=gen) * scale)
        setattr(layer.get_submodule(module), attr,
                torch.nn.Parameter(value if attr == "weight" else value.to(torch.bfloat16), requires_grad=False))
    layer.gate.prepack_weights()
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 8, 16])
def test_moe_layer_with_shared_experts_matches_torch_gpu(tokens):
    """The whole V2-Lite MoE layer on CUDA (the one-launch router up to 16 tokens, shared experts stacked in) == the
    same layer's weights through the PyTorch router and reference on fp32 copies; and the routing itself."""
    from braid.runtime.layers.moe.router import route_hidden

    layer = v2_lite_moe_layer()
    x = torch.randn(tokens, LITE["hidden"], device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    x = x.to(torch.bfloat16)
    weights, ids = route_hidden(x, layer.gate.weight, layer.spec, num_shared=2)
    ref_weights, ref_ids = select_experts_torch(x.float() @ layer.gate.weight.T, layer.spec, num_shared=2)
    got_w, got_ids = sorted_routing(weights.cpu(), ids.cpu())
    want_w, want_ids = sorted_routing(ref_weights.cpu(), ref_ids.cpu())
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-4, atol=1e-5)
    out = layer(x)
    ref = fp32_reference(x, layer.w13_weight, layer.w2_weight, ref_weights, ref_ids)
    torch_err = rel_err(moe_forward_torch(x, layer.w13_weight, layer.w2_weight, ref_weights, ref_ids), ref)
    assert rel_err(out, ref) < max(1e-2, 1.5 * torch_err)
    # with the add-RMSNorm before it (inside the router's launch up to 16 tokens) == the norm, then the layer
    from braid.runtime.layers.norm import RMSNorm

    norm = RMSNorm(LITE["hidden"]).cuda()
    norm.weight.data = torch.rand(LITE["hidden"], device="cuda") + 0.5
    residual = torch.randn_like(x)
    fused_out, fused_residual = layer.forward_after_norm(x, residual, norm)
    normed, want_residual = norm(x, residual)
    assert torch.equal(fused_residual, want_residual)
    assert rel_err(fused_out, layer(normed)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_small_batch_moe_layers_replay_in_cuda_graph_gpu(tokens):
    """Three MoE layers in a row in one CUDA graph (PDL launches; the routers, each with the add-RMSNorm before it,
    share one arrival counter, which each launch's last program resets): every replay with new inputs equals the
    eager pass."""
    from braid.runtime.layers.norm import RMSNorm

    layers = [v2_lite_moe_layer(seed) for seed in range(3)]
    norm = RMSNorm(LITE["hidden"]).cuda()
    norm.weight.data.fill_(1.0)
    static_x = torch.zeros(tokens, LITE["hidden"], device="cuda", dtype=torch.bfloat16)

    def step():
        h, residual = static_x, static_x
        for layer in layers:
            h, residual = layer.forward_after_norm(h, residual, norm)
        return h + residual

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (2, 3, 4):
        static_x.copy_(torch.randn(static_x.shape, generator=torch.Generator().manual_seed(seed)).to("cuda",
                                                                                                      torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, step()), seed


@pytest.mark.gpu
def test_fused_moe_replays_in_cuda_graph_gpu():
    tokens = 32
    x, w13, w2, weights, ids = random_moe_inputs(tokens, LITE["experts"], LITE["top_k"], LITE["hidden"],
                                                 LITE["inter"], torch.bfloat16, "cuda", seed=5)
    spec = MoESpec(LITE["experts"], LITE["top_k"], LITE["inter"], topk_method="group_limited_greedy", n_group=8,
                   topk_group=3)
    gate = torch.randn(LITE["experts"], LITE["hidden"], device="cuda")
    static_x = x.clone()

    def step():
        w, i = select_experts(static_x.float() @ gate.T, spec)
        return fused_experts(static_x, w13, w2, w, i)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (6, 7):
        static_x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to("cuda", x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, step())
