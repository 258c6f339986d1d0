"""ModelConfig parsed from the config dicts HF transformers' own config classes produce (no model is loaded)."""

import math
from types import SimpleNamespace

import pytest
import torch
import transformers

from braid.runtime.dtypes import kv_cache_dtype, model_dtype
from braid.runtime.loader.model_config import LayerSpec, ModelConfig, RopeSpec

TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}


def parse(hf_config) -> ModelConfig:
    return ModelConfig.from_hf(hf_config.to_dict(), SimpleNamespace(context_length=None), None)


def test_llama_layers_and_llama3_rope():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    mc = parse(transformers.LlamaConfig(**TINY, rope_scaling=rope, rope_theta=500000.0))
    assert mc.architecture == "LlamaForCausalLM" and mc.num_layers == 4 and mc.attention_arch == "mha"
    assert mc.layers == (LayerSpec("mha", 4, 2, 16, 16, 16 ** -0.5),) * 4
    assert (mc.head_dim, mc.v_head_dim, mc.num_key_value_heads, mc.context_len) == (16, 16, 2, 512)
    assert mc.rope == RopeSpec(theta=500000.0, rotary_dim=16, max_position=512, scaling_type="llama3", factor=8.0,
                               original_max_position=64, low_freq_factor=1.0, high_freq_factor=4.0)
    assert mc.rope.scaling_dict()["rope_type"] == "llama3"
    assert not mc.attention_bias and not mc.attention_out_bias and not mc.tie_word_embeddings
    assert mc.hidden_act == "silu" and mc.eos_token_ids == (2,)
    assert mc.moe is None and mc.mla is None and mc.vision is None and mc.quantization is None
    assert not mc.is_multimodal


def test_llama_attention_bias_covers_o_proj():
    mc = parse(transformers.LlamaConfig(**TINY, attention_bias=True))
    assert mc.attention_bias and mc.attention_out_bias


def test_mistral_window_on_every_layer():
    mc = parse(transformers.MistralConfig(**TINY, sliding_window=16))
    assert mc.architecture == "MistralForCausalLM"
    assert [layer.sliding_window for layer in mc.layers] == [16] * 4
    assert mc.rope.scaling_type == "none" and mc.rope.scaling_dict() is None


def test_qwen2_qkv_bias_and_no_window_by_default():
    mc = parse(transformers.Qwen2Config(**TINY))
    assert mc.architecture == "Qwen2ForCausalLM"
    assert mc.attention_bias and not mc.attention_out_bias
    assert all(layer.sliding_window is None for layer in mc.layers)
    windowed = parse(transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert [layer.sliding_window for layer in windowed.layers] == [None, None, 8, 8]


def test_qwen2_config_json_without_layer_types():
    raw = {**transformers.Qwen2Config(**TINY).to_dict(), "use_sliding_window": False, "sliding_window": 4096}
    del raw["layer_types"]
    assert all(layer.sliding_window is None for layer in ModelConfig.from_hf(raw).layers)


def test_smollm2_style_tied_embeddings():
    mc = parse(transformers.LlamaConfig(**TINY, tie_word_embeddings=True))
    assert mc.tie_word_embeddings


def test_gemma2_window_on_even_layers_and_soft_caps():
    mc = parse(transformers.Gemma2Config())
    assert mc.architecture == "Gemma2ForCausalLM" and mc.num_layers == 26
    assert [layer.sliding_window for layer in mc.layers] == [4096 if i % 2 == 0 else None for i in range(26)]
    assert all(layer.logit_cap == 50.0 for layer in mc.layers)
    assert mc.final_logit_softcap == 30.0
    assert all(math.isclose(layer.scaling, 256 ** -0.5) for layer in mc.layers)  # query_pre_attn_scalar
    assert (mc.layers[0].head_dim, mc.layers[0].num_heads, mc.layers[0].num_kv_heads) == (256, 8, 4)
    assert mc.hidden_act == "gelu_tanh" and mc.tie_word_embeddings
    assert mc.eos_token_ids == (1,)


def test_gemma2_config_json_without_layer_types():
    raw = transformers.Gemma2Config(num_hidden_layers=4, query_pre_attn_scalar=144).to_dict()
    del raw["layer_types"]
    mc = ModelConfig.from_hf(raw)
    assert [layer.sliding_window for layer in mc.layers] == [4096, None, 4096, None]
    assert math.isclose(mc.layers[0].scaling, 144 ** -0.5)


def test_deepseek_v2_mla_moe_yarn():
    cfg = transformers.DeepseekV2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, max_position_embeddings=163840, rope_scaling=YARN)
    mc = parse(cfg)
    assert mc.architecture == "DeepseekV2ForCausalLM" and mc.attention_arch == "mla"
    assert (mc.kv_lora_rank, mc.qk_rope_head_dim, mc.head_dim, mc.v_head_dim) == (32, 8, 40, 32)
    assert mc.mla.q_lora_rank is None and mc.mla.qk_nope_head_dim == 16
    assert [layer.is_moe for layer in mc.layers] == [False, True, True, True]
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    for layer in mc.layers:
        assert (layer.attention, layer.num_heads, layer.head_dim, layer.v_head_dim) == ("mla", 4, 24, 16)
        assert math.isclose(layer.scaling, 24 ** -0.5 * mscale ** 2)
    assert mc.rope.scaling_type == "yarn" and mc.rope.rotary_dim == 8 and not mc.rope.is_neox_style
    assert (mc.rope.factor, mc.rope.original_max_position, mc.rope.mscale, mc.rope.mscale_all_dim) == (40.0, 4096, 0.707, 0.707)
    moe = mc.moe
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_shared_experts, moe.moe_intermediate_size) == (8, 2, 1, 32)
    assert (moe.topk_method, moe.n_group, moe.topk_group, moe.first_k_dense_replace) == ("group_limited_greedy", 4, 2, 1)


def test_deepseek_moe_layer_freq_from_config_json():
    raw = transformers.DeepseekV2Config(num_hidden_layers=6, num_experts_per_tok=2).to_dict()
    raw.update(first_k_dense_replace=1, moe_layer_freq=2)
    assert [layer.is_moe for layer in ModelConfig.from_hf(raw).layers] == [False, False, True, False, True, False]


def test_llava_onevision_vision_config():
    text = transformers.Qwen2Config(**TINY)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=384, patch_size=14)
    mc = parse(transformers.LlavaOnevisionConfig(text_config=text, vision_config=vision))
    assert mc.architecture == "LlavaOnevisionForConditionalGeneration" and mc.is_multimodal
    assert mc.attention_bias and mc.num_layers == 4  # the text model's fields
    v = mc.vision
    assert (v.hidden_size, v.num_hidden_layers, v.image_size, v.patch_size, v.hidden_act) == (32, 2, 384, 14, "gelu_tanh")
    assert (v.image_token_id, v.video_token_id, v.feature_select_strategy) == (151646, 151647, "full")
    assert v.image_grid_pinpoints[0] == (384, 384) and v.vision_aspect_ratio == "anyres_max_9"


def test_quantization_config():
    raw = {**transformers.LlamaConfig(**TINY).to_dict(),
           "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    q = ModelConfig.from_hf(raw).quantization
    assert (q.method, q.activation_scheme, q.weight_block_size) == ("fp8", "dynamic", (128, 128))


def test_context_length_override():
    assert parse(transformers.LlamaConfig(**TINY)).context_len == 512
    mc = ModelConfig.from_hf(transformers.LlamaConfig(**TINY).to_dict(), SimpleNamespace(context_length=100))
    assert mc.context_len == 100


@pytest.mark.parametrize("missing", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                     "intermediate_size"])
def test_unknown_model_type_missing_field_names_it(missing):
    raw = {"model_type": "newfamily", "architectures": ["NewForCausalLM"], **TINY}
    del raw[missing]
    with pytest.raises(ValueError, match=f"'newfamily'.*'{missing}'"):
        ModelConfig.from_hf(raw)


def test_unknown_model_type_without_architectures():
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_hf({"model_type": "newfamily", **TINY})


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"hidden_act": "relu"}, "relu"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"quantization_config": {"bits": 4}}, "quant_method"),
])
def test_invalid_configs_fail_clearly(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({"model_type": "llama", **TINY, **change})


def test_frozen():
    mc = parse(transformers.LlamaConfig(**TINY))
    with pytest.raises(AttributeError):
        mc.vocab_size = 5


def test_dtype_helpers():
    assert model_dtype("auto", "cuda") == torch.bfloat16 and model_dtype("auto", "cpu") == torch.float32
    assert model_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="fp8_e5m2"):
        model_dtype("fp8_e5m2", "cuda")
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype(None, torch.float16) == torch.float16
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) == kv_cache_dtype("fp8_e4m3fn", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    for bad in ("int4", torch.int8):
        with pytest.raises(ValueError):
            kv_cache_dtype(bad, torch.bfloat16)
