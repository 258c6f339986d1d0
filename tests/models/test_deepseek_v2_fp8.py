"""DeepSeek-V2 FP8 checkpoints (issue 17): e4m3 linear layers with per-row scales (per tensor for some experts), the
experts dequantized at load, kv_b_proj split into the absorbed w_kc / w_vc kept in e4m3 with its row scales. A tiny random model is saved by HF,
its linear weights quantized into an FP8 folder (quantization_config fp8, dynamic activations) and, dequantized, into
a dense folder that HF loads as the reference: with activations left unrounded, braid on the FP8 folder equals HF
(absorbed and expanded MLA); with them rounded per token to e4m3 as braid computes, the FP8 folder equals
--quantization fp8 on the dense folder exactly."""

from __future__ import annotations

import glob
import json
import os
from unittest import mock

import pytest
import torch

from braid.runtime.layers.quantization import fp8 as fp8_method
from braid.runtime.layers.quantization.fp8_kernels import FP8_DTYPE, quantize_weight_per_channel
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


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(FP8 folder, dense folder of the dequantized weights, HF on the dense folder, HF's greedy sequence + logits)."""
    import transformers
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("dsv2_fp8")
    _checkpoint(root / "hf", q_lora=True)
    tensors = {}
    for f in glob.glob(str(root / "hf" / "*.safetensors")):
        tensors.update(load_file(f))
    quantized, dense = {}, {}
    for name, w in tensors.items():
        if w.dim() == 2 and name.endswith(("_proj.weight", "proj_with_mqa.weight")):
            expert = name.split(".experts.")[1].split(".")[0] if ".experts." in name else None
            if expert is not None and int(expert) % 2 == 0:
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
    hf = transformers.DeepseekV2ForCausalLM.from_pretrained(str(root / "dense"), dtype=torch.float32).eval()
    return str(root / "fp8"), str(root / "dense"), _hf_sequence(hf, _prompt(5))


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


def test_fp8_checkpoint_equals_quantizing_the_dense_weights_at_load(folders):
    """The FP8 folder and --quantization fp8 on its dequantized dense copy compute the same logits (the same e4m3
    values and scales), activations rounded per token as braid runs them, which moves them off the dense model's."""
    fp8_path, dense_path, (seq, _) = folders
    from_checkpoint = _logits(fp8_path, seq)
    assert torch.equal(from_checkpoint, _logits(dense_path, seq, quantization="fp8"))
    assert (from_checkpoint - _logits(dense_path, seq)).abs().max().item() > 1e-3


def test_fp8_expert_weight_without_its_scale_is_refused(tmp_path):
    from braid.runtime.layers.moe import dequantize_fp8_experts

    q, scale = quantize_weight_per_channel(torch.randn(4, 8))
    weights = [("model.layers.1.mlp.experts.0.up_proj.weight", q), ("model.norm.weight", torch.ones(8)),
               ("model.layers.1.mlp.experts.1.up_proj.weight", q),
               ("model.layers.1.mlp.experts.1.up_proj.weight_scale", scale.reshape(-1, 1)),
               ("model.layers.1.mlp.experts.1.up_proj.input_scale", torch.ones(1))]
    out = dequantize_fp8_experts(iter(weights), torch.float32)
    assert next(out)[0] == "model.norm.weight"
    name, dense = next(out)
    assert name == "model.layers.1.mlp.experts.1.up_proj.weight" and dense.dtype == torch.float32
    torch.testing.assert_close(dense, q.float() * scale[:, None])
    with pytest.raises(ValueError, match=r"without their pair.*experts\.0\.up_proj\.weight_scale"):
        next(out)


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
