"""DeepSeek-V2 FP8 checkpoints (issue 17): e4m3 linear layers with per-row scales (per tensor for some experts), the
experts kept in e4m3 with their scales, kv_b_proj split into the absorbed w_kc / w_vc kept in e4m3 with its row
scales. A tiny random model is saved by HF, its linear weights quantized into an FP8 folder (quantization_config fp8,
dynamic activations) and, dequantized, into a dense folder that HF loads as the reference: with activations left
unrounded, braid on the FP8 folder equals HF (absorbed and expanded MLA); with them rounded per token to e4m3 as braid
computes, an FP8 folder of per-row scales equals --quantization fp8 on its dense folder exactly."""

from __future__ import annotations

import glob
import json
import os
from unittest import mock

import pytest
import torch

from braid.runtime.layers.quantization import fp8 as fp8_method
from braid.runtime.layers.quantization.fp8_quantize import FP8_DTYPE, quantize_weight_per_channel
from test_deepseek_v2_parity import PROMPT_LEN, Driver, _checkpoint, _hf_sequence, _prompt, _runner

DECODE_STEPS = 10


def _per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max().float().clamp_min(1e-12) / torch.finfo(FP8_DTYPE).max
    return (w.float() / scale).to(FP8_DTYPE), scale.reshape(1)


def _write(path: str, tensors: dict, config: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _fp8_and_dense_folders(root, per_tensor_experts: bool) -> tuple[str, str]:
    """A tiny HF DeepSeek-V2 quantized into an FP8 folder (every linear weight per row; with per_tensor_experts the
    even experts per tensor) and its dequantized dense copy."""
    from safetensors.torch import load_file

    _checkpoint(root / "hf", q_lora=True)
    tensors = {}
    for f in glob.glob(str(root / "hf" / "*.safetensors")):
        tensors.update(load_file(f))
    quantized, dense = {}, {}
    for name, w in tensors.items():
        if w.dim() == 2 and name.endswith(("_proj.weight", "proj_with_mqa.weight")):
            expert = name.split(".experts.")[1].split(".")[0] if ".experts." in name else None
            if per_tensor_experts and expert is not None and int(expert) % 2 == 0:
                q, scale = _per_tensor(w)
                dense[name] = (q.float() * scale).to(w.dtype)
            else:
                q, scale = quantize_weight_per_channel(w.float())
                dense[name] = (q.float() * scale[:, None]).to(w.dtype)
                scale = scale.reshape(-1, 1)
            quantized[name], quantized[name.removesuffix("weight") + "weight_scale"] = q, scale
        else:
            quantized[name] = dense[name] = w.contiguous()
    assert any(".experts." in n and n.endswith("weight_scale") for n in quantized)
    config = json.loads((root / "hf" / "config.json").read_text())
    _write(str(root / "fp8"), quantized, {**config, "quantization_config": {"quant_method": "fp8",
                                                                             "activation_scheme": "dynamic"}})
    _write(str(root / "dense"), dense, config)
    return str(root / "fp8"), str(root / "dense")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(FP8 folder with per-tensor and per-row experts, dense folder of the dequantized weights, HF's greedy sequence
    + logits on the dense folder)."""
    import transformers

    fp8, dense = _fp8_and_dense_folders(tmp_path_factory.mktemp("dsv2_fp8"), per_tensor_experts=True)
    hf = transformers.DeepseekV2ForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    return fp8, dense, _hf_sequence(hf, _prompt(5))


def _logits(path: str, seq: list[int], **kw) -> torch.Tensor:
    """Prefill PROMPT_LEN tokens, then DECODE_STEPS decodes fed with seq's tokens -> logits [rows, V]."""
    runner = _runner(path, **kw)
    driver, row = Driver(runner), runner.req_to_token_pool.alloc()
    got = [driver.extend(row, seq[:PROMPT_LEN], 0)]
    for step in range(DECODE_STEPS):
        got.append(driver.decode([row], [seq[PROMPT_LEN + step]], [PROMPT_LEN + step]))
    return torch.cat(got)


def _unrounded_rows(x, static_scale=None):
    return x, torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)


@pytest.mark.parametrize("disable_mla", [False, True])
def test_fp8_checkpoint_weights_equal_hf_with_activations_unrounded(folders, disable_mla):
    """Every e4m3 weight and scale (q_a / q_b / kv_a / kv_b / o, the dense MLP, routed and shared experts per row or
    per tensor) lands where HF's dequantized model has it: with x not rounded to fp8, logits equal HF's."""
    fp8_path, _, (seq, ref) = folders
    with mock.patch.object(fp8_method, "quantize_rows", _unrounded_rows):
        got = _logits(fp8_path, seq, disable_mla=disable_mla)
    assert (got - ref[: got.shape[0]]).abs().max().item() <= 1e-3


def test_fp8_checkpoint_equals_quantizing_the_dense_weights_at_load(folders, tmp_path):
    """An FP8 folder of per-row scales and --quantization fp8 on its dequantized dense copy compute the same logits
    (the same e4m3 values and scales, experts included), activations rounded per token as braid runs them, which
    moves them off the dense model's. (Per-tensor experts would requantize per row at other values.)"""
    _, _, (seq, _) = folders
    fp8_path, dense_path = _fp8_and_dense_folders(tmp_path, per_tensor_experts=False)
    from_checkpoint = _logits(fp8_path, seq)
    assert torch.equal(from_checkpoint, _logits(dense_path, seq, quantization="fp8"))
    assert (from_checkpoint - _logits(dense_path, seq)).abs().max().item() > 1e-3


def test_fp8_expert_weight_without_its_scale_is_refused(folders):
    from safetensors.torch import load_file

    fp8_path, _, _ = folders
    runner_model = _runner(fp8_path).model
    stored = load_file(os.path.join(fp8_path, "model.safetensors"))
    name = next(n for n in stored if ".experts.1.up_proj.weight" in n and not n.endswith("_scale"))
    with pytest.raises(ValueError, match=r"without their pair.*experts\.1\.up_proj\.weight_scale"):
        runner_model.load_weights([(name, stored[name])], "cpu")


def test_fp8_checkpoint_experts_stay_e4m3_with_row_scales(folders):
    """The experts of an FP8 checkpoint load as its e4m3 values with their scales (a per-tensor scale on every row),
    shared experts included: half the bytes of bf16 experts, a quarter of this fp32 test model's."""
    from safetensors.torch import load_file

    fp8_path, dense_path, _ = folders
    moe = next(m for m in _runner(fp8_path).model.modules() if type(m).__name__ == "FusedMoE")
    dense_moe = next(m for m in _runner(dense_path).model.modules() if type(m).__name__ == "FusedMoE")
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == FP8_DTYPE and dense_moe.w13_scale is None
    assert moe.w13_weight.nbytes * 4 == dense_moe.w13_weight.nbytes
    stored = load_file(os.path.join(fp8_path, "model.safetensors"))
    layer = next(n.split(".mlp.")[0] for n in stored if ".experts.0.up_proj.weight" in n)
    inter = moe.intermediate_per_rank
    for expert in (0, 1):  # per tensor, per row
        stem = f"{layer}.mlp.experts.{expert}.up_proj"
        want = stored[f"{stem}.weight"].float() * stored[f"{stem}.weight_scale"].float().reshape(-1, 1)
        got = moe.w13_weight[expert, inter:].float() * moe.w13_scale[expert, inter:, None]
        torch.testing.assert_close(got, want)


def test_absorbed_w_kc_w_vc_stay_e4m3_with_row_scales(folders):
    """Absorbed, the fp8 kv_b_proj becomes e4m3 w_kc / w_vc (half the bytes the decode kernels stream) with its row
    scales [H, rows]; dequantized they are kv_b_proj's rows as the checkpoint holds them."""
    from safetensors.torch import load_file

    fp8_path, dense_path, _ = folders
    attn = _runner(fp8_path).model.model.layers[0].self_attn
    dense_attn = _runner(dense_path).model.model.layers[0].self_attn
    assert attn.w_kc.dtype == attn.w_vc.dtype == FP8_DTYPE and dense_attn.w_kc_scale is None
    assert attn.w_kc_scale.shape == attn.w_kc.shape[:2] and attn.w_vc_scale.shape == attn.w_vc.shape[:2]
    assert attn.w_kc.nbytes * 4 == dense_attn.w_kc.nbytes  # e4m3 against the fp32 test model
    stored = load_file(os.path.join(fp8_path, "model.safetensors"))
    w = stored["model.layers.0.self_attn.kv_b_proj.weight"].float() * stored[
        "model.layers.0.self_attn.kv_b_proj.weight_scale"].float().reshape(-1, 1)
    w = w.view(attn.num_heads, attn.nope_dim + attn.v_head_dim, attn.kv_lora_rank)
    torch.testing.assert_close(attn.w_kc.float() * attn.w_kc_scale[..., None], w[:, :attn.nope_dim])
    torch.testing.assert_close(attn.w_vc.float() * attn.w_vc_scale[..., None], w[:, attn.nope_dim:])


def test_dummy_weights_with_quantization_fp8_quantize_the_experts(folders):
    """--load-format dummy --quantization fp8 (the GPU benchmarks' form): random dense experts quantized per row after
    they materialize, and the model runs on them."""
    _, dense_path, (seq, _) = folders
    moe = next(m for m in _runner(dense_path, load_format="dummy", quantization="fp8").model.modules()
               if type(m).__name__ == "FusedMoE")
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == FP8_DTYPE
    assert moe.w13_scale.shape == moe.w13_weight.shape[:2] and (moe.w13_scale > 0).all()
    assert torch.isfinite(_logits(dense_path, seq, load_format="dummy", quantization="fp8")).all()
