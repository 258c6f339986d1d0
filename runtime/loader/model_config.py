"""ModelConfig: a frozen, typed view of a checkpoint's config.json (or of a GGUF's metadata in the same shape).

Models read only this. Family facts that config.json leaves implicit (Qwen2's qkv bias, Gemma-2's window on even
layers, Gemma-3's and Qwen3's q/k norms, Gemma-3's window pattern, DeepSeek's interleaved rope) are settled here, so
no model checks `model_type`. The raw dict stays in `hf` for the weight readers (GGUF) and the HF reference in
benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from braid.runtime.dtypes import model_dtype
from braid.runtime.loader.config_specs import (AttentionKind, HIDDEN_ACTS, LayerSpec, MLASpec, MoESpec,
                                               QuantizationSpec, RopeSpec, VisionConfig, yarn_mscale)

__all__ = ["ModelConfig", "LayerSpec", "RopeSpec", "MLASpec", "MoESpec", "VisionConfig", "QuantizationSpec"]

_HF_ROPE_TYPES = {"default": "none", "llama3": "llama3", "linear": "linear", "yarn": "yarn", "deepseek_yarn": "yarn"}
_HF_HIDDEN_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                   "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
_HF_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
# used when config.json has no `architectures` (configs built in tests, dummy configs)
_DEFAULT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "llava_onevision": "LlavaOnevisionForConditionalGeneration",
}
_INTERLEAVED_ROPE_FAMILIES = ("deepseek_v2", "deepseek_v3")
_TIED_BY_DEFAULT_FAMILIES = ("gemma", "gemma2", "gemma3_text")
_QK_NORM_FAMILIES = ("gemma3_text", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    hf: dict = field(repr=False, compare=False)
    path: Optional[str]
    architecture: str
    model_type: str
    layers: tuple[LayerSpec, ...]
    rope: RopeSpec
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    context_len: int
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v projections
    attention_out_bias: bool = False  # o projection
    mlp_bias: bool = False
    final_logit_softcap: float = 0.0
    mla: Optional[MLASpec] = None
    moe: Optional[MoESpec] = None
    vision: Optional[VisionConfig] = None
    quantization: Optional[QuantizationSpec] = None
    num_tensors_hint: Optional[int] = None
    mla_expanded: bool = False  # --disable-mla: MLA layers cache per-head K and V (the MHA layout), not the latent

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a model needs at least one layer (num_hidden_layers)")
        if min(self.hidden_size, self.intermediate_size, self.vocab_size, self.context_len) <= 0:
            raise ValueError("hidden_size, intermediate_size, vocab_size and context length must be positive")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; expected one of {HIDDEN_ACTS}")
        kinds = {layer.attention for layer in self.layers}
        if kinds != {"mla" if self.mla is not None else "mha"}:
            raise ValueError(f"layers' attention kinds {sorted(kinds)} disagree with the MLA fields (mla={self.mla})")
        kv_shapes = {(layer.num_kv_heads, layer.head_dim, layer.v_head_dim) for layer in self.layers}
        if len(kv_shapes) > 1:
            raise ValueError(f"layers differ in KV shape {sorted(kv_shapes)}; the KV pool holds one shape")
        if any(layer.is_moe for layer in self.layers) and self.moe is None:
            raise ValueError("a layer is marked MoE but the config has no MoE fields")
        if self.rms_norm_eps <= 0 or self.final_logit_softcap < 0:
            raise ValueError("rms_norm_eps must be > 0 and final_logit_softcap >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attention_arch(self) -> AttentionKind:
        """How the KV cache and attention backends see the layers: 'mla' (one latent per token) or 'mha'."""
        return "mla" if self.mla is not None and not self.mla_expanded else "mha"

    @property
    def head_dim(self) -> int:
        """K per token and KV head as the KV cache holds it (MLA: the latent plus the rope part)."""
        return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim if self.attention_arch == "mla" else self.layers[0].head_dim

    @property
    def v_head_dim(self) -> int:
        return self.mla.kv_lora_rank if self.attention_arch == "mla" else self.layers[0].v_head_dim

    @property
    def kv_lora_rank(self) -> int:
        return self.mla.kv_lora_rank if self.mla is not None else 0

    @property
    def qk_rope_head_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla is not None else 0

    @property
    def is_multimodal(self) -> bool:
        return self.vision is not None

    def torch_dtype(self, requested: str, device: str) -> torch.dtype:
        return model_dtype(requested, device)

    @classmethod
    def from_hf(cls, raw: dict, server_args=None, path: Optional[str] = None,
                generation_config: Optional[dict] = None) -> "ModelConfig":
        """raw: config.json's dict; generation_config: generation_config.json's, whose eos_token_id (a chat model's
        end-of-turn, e.g. Gemma's <end_of_turn>) ends generation too, as in HF, vLLM and SGLang."""
        return _parse(raw, getattr(server_args, "context_length", None), path,
                      getattr(server_args, "disable_mla", False), generation_config or {})


def _eos_ids(*values) -> tuple[int, ...]:
    """The ids of several eos_token_id fields (an int, a list or None), in order, once each."""
    ids = [i for v in values if v is not None for i in (v if isinstance(v, (list, tuple)) else [v])]
    return tuple(dict.fromkeys(int(i) for i in ids))


def _parse(raw: dict, context_length: Optional[int], path: Optional[str], disable_mla: bool = False,
           generation_config: Optional[dict] = None) -> ModelConfig:
    text = raw.get("text_config") or raw
    family = text.get("model_type") or raw.get("model_type") or "llama"

    def need(key: str):
        if text.get(key) is None:
            raise ValueError(f"config (model_type {family!r}) has no {key!r}")
        return text[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    num_layers = int(need("num_hidden_layers"))
    mla = _parse_mla(text, need)
    if mla is not None:
        kv_heads = heads  # expanded MLA keys and values are per query head
    elif disable_mla:
        raise ValueError(f"--disable-mla applies to models with multi-head latent attention (DeepSeek-V2); this "
                         f"config (model_type {family!r}) has none")
    head_dim = int(text.get("head_dim") or hidden // heads)
    rope, window_rope = _parse_ropes(text, family, mla.qk_rope_head_dim if mla else head_dim)
    moe = _parse_moe(text, need)
    layers = _parse_layers(text, family, num_layers, heads, kv_heads, head_dim, mla, moe, rope, window_rope)
    eos = _eos_ids(raw.get("eos_token_id", text.get("eos_token_id")), (generation_config or {}).get("eos_token_id"))
    qkv_bias = family == "qwen2" or bool(text.get("attention_bias", False))
    if text.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder-style variant) is not supported: braid runs causal "
                         "decoders")
    act = text.get("hidden_activation") or text.get("hidden_act") or "silu"
    if act not in _HF_HIDDEN_ACTS:
        raise ValueError(f"hidden_act {act!r} is not supported; expected one of {sorted(_HF_HIDDEN_ACTS)}")
    return ModelConfig(
        hf=raw,
        path=path,
        architecture=_architecture(raw),
        model_type=raw.get("model_type") or family,
        layers=layers,
        rope=rope,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        vocab_size=int(need("vocab_size")),
        context_len=int(context_length or text.get("max_position_embeddings") or 4096),
        eos_token_ids=eos,
        hidden_act=_HF_HIDDEN_ACTS[act],
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings",
                                                                         family in _TIED_BY_DEFAULT_FAMILIES))),
        attention_bias=qkv_bias,
        attention_out_bias=family != "qwen2" and qkv_bias,
        mlp_bias=bool(text.get("mlp_bias", False)),
        final_logit_softcap=float(text.get("final_logit_softcapping") or 0.0),
        mla=mla,
        moe=moe,
        vision=_parse_vision(raw),
        quantization=_parse_quantization(raw.get("quantization_config") or text.get("quantization_config")),
        mla_expanded=mla is not None and bool(disable_mla),
    )


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures")
    if archs:
        return archs[0]
    model_type = raw.get("model_type") or "llama"
    if model_type not in _DEFAULT_ARCHITECTURES:
        raise ValueError(f"config (model_type {model_type!r}) has no 'architectures'")
    return _DEFAULT_ARCHITECTURES[model_type]


def _parse_mla(text: dict, need) -> Optional[MLASpec]:
    if text.get("kv_lora_rank") is None:
        return None
    return MLASpec(kv_lora_rank=int(text["kv_lora_rank"]), qk_nope_head_dim=int(need("qk_nope_head_dim")),
                   qk_rope_head_dim=int(need("qk_rope_head_dim")), v_head_dim=int(need("v_head_dim")),
                   q_lora_rank=text.get("q_lora_rank"))


def _parse_ropes(text: dict, family: str, head_dim: int) -> tuple[RopeSpec, Optional[RopeSpec]]:
    """-> (the rope of the full-attention layers, the sliding-window layers' own rope or None where they share it).
    Ropes per layer type come keyed by layer type in `rope_parameters` (transformers 5) or, in Gemma-3's older
    configs, as `rope_local_base_freq` (the window layers' theta, unscaled; rope_theta and rope_scaling are the
    global layers')."""
    params = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if _HF_LAYER_TYPES.keys() & params.keys():
        if params.keys() - _HF_LAYER_TYPES.keys():
            raise ValueError(f"rope_parameters mixes layer types with other keys: {sorted(params)}")
        full, sliding = params.get("full_attention"), params.get("sliding_attention")
        full_rope = _rope_spec(full or sliding, text, family, head_dim)
        sliding_rope = _rope_spec(sliding, text, family, head_dim) if full and sliding else None
        return full_rope, None if sliding_rope == full_rope else sliding_rope
    full_rope = _rope_spec(params, text, family, head_dim)
    local_theta = text.get("rope_local_base_freq")
    if local_theta is None or float(local_theta) == full_rope.theta and full_rope.scaling_type == "none":
        return full_rope, None
    return full_rope, _rope_spec({"rope_theta": local_theta}, text, family, head_dim)


def _rope_spec(params: dict, text: dict, family: str, head_dim: int) -> RopeSpec:
    """One rope from HF's rope parameters (rope_scaling's or rope_parameters' shape; rope_theta there or in text)."""
    theta = params.get("rope_theta") or text.get("rope_theta") or 10000.0
    hf_type = params.get("rope_type") or params.get("type") or "default"
    if hf_type not in _HF_ROPE_TYPES:
        raise ValueError(f"rope scaling type {hf_type!r} is not supported; expected one of {sorted(_HF_ROPE_TYPES)}")
    if hf_type in ("yarn", "deepseek_yarn") and (params.get("attention_factor") is not None
                                                 or params.get("truncate", True) is False):
        raise ValueError("yarn rope with attention_factor or truncate=false is not supported")
    scaling = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                                      "mscale", "mscale_all_dim") if params.get(k) is not None}
    if hf_type == "default":
        scaling = {}  # rope_parameters may carry a factor of 1.0 beside the default type
    original = params.get("original_max_position_embeddings")
    return RopeSpec(theta=float(theta), rotary_dim=int(head_dim * text.get("partial_rotary_factor", 1.0)),
                    max_position=int(text.get("max_position_embeddings") or 4096),
                    scaling_type=_HF_ROPE_TYPES[hf_type],
                    original_max_position=int(original) if original is not None else None,
                    is_neox_style=family not in _INTERLEAVED_ROPE_FAMILIES,
                    **{k: float(v) for k, v in scaling.items()})


def _parse_moe(text: dict, need) -> Optional[MoESpec]:
    if text.get("n_routed_experts") is None:
        return None
    if text.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"MoE scoring_func {text['scoring_func']!r} is not supported (braid's router takes a softmax)")
    optional = {k: text[k] for k in ("topk_method", "n_group", "topk_group", "norm_topk_prob",
                                     "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq")
                if text.get(k) is not None}
    return MoESpec(n_routed_experts=int(text["n_routed_experts"]), num_experts_per_tok=int(need("num_experts_per_tok")),
                   moe_intermediate_size=int(need("moe_intermediate_size")),
                   n_shared_experts=int(text.get("n_shared_experts") or 0), **optional)


def _window_flags(text: dict, family: str, num_layers: int) -> list[bool]:
    """Which layers attend through `sliding_window` (when the config sets one)."""
    layer_types = text.get("layer_types")
    if layer_types:
        unknown = set(layer_types) - _HF_LAYER_TYPES.keys()
        if unknown or len(layer_types) != num_layers:
            raise ValueError(f"layer_types must list {num_layers} of {sorted(_HF_LAYER_TYPES)}; got {layer_types}")
        return [_HF_LAYER_TYPES[t] for t in layer_types]
    if family == "gemma2":
        return [i % 2 == 0 for i in range(num_layers)]
    if family == "gemma3_text":  # every pattern-th layer global (HF's default 6)
        pattern = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or 6)
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    if family == "qwen2":
        if not text.get("use_sliding_window", False):
            return [False] * num_layers
        return [i >= text.get("max_window_layers", 28) for i in range(num_layers)]
    return [True] * num_layers  # Mistral and the rest: a configured window applies everywhere


def _parse_layers(text: dict, family: str, num_layers: int, heads: int, kv_heads: int, head_dim: int,
                  mla: Optional[MLASpec], moe: Optional[MoESpec], rope: RopeSpec,
                  window_rope: Optional[RopeSpec]) -> tuple[LayerSpec, ...]:
    logit_cap = float(text.get("attn_logit_softcapping") or 0.0)
    if mla is not None:
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        scaling = qk_dim ** -0.5
        if rope.scaling_type == "yarn" and rope.mscale_all_dim:
            scaling *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        return tuple(LayerSpec("mla", heads, heads, qk_dim, mla.v_head_dim, scaling, None, logit_cap,
                               moe is not None and moe.is_moe_layer(i)) for i in range(num_layers))
    scalar = text.get("query_pre_attn_scalar")
    scaling = (scalar if scalar is not None else head_dim) ** -0.5
    window = text.get("sliding_window")
    flags = _window_flags(text, family, num_layers)
    return tuple(LayerSpec("mha", heads, kv_heads, head_dim, head_dim, scaling, window if flags[i] else None,
                           logit_cap, moe is not None and moe.is_moe_layer(i), window_rope if flags[i] else None,
                           qk_norm=family in _QK_NORM_FAMILIES) for i in range(num_layers))


def _parse_vision(raw: dict) -> Optional[VisionConfig]:
    vc = raw.get("vision_config")
    if not vc:
        return None

    def need(key: str):
        if vc.get(key) is None:
            raise ValueError(f"vision_config has no {key!r}")
        return vc[key]

    feature_layer = raw.get("vision_feature_layer", -1)
    act, projector_act = vc.get("hidden_act", "gelu_pytorch_tanh"), raw.get("projector_hidden_act", "gelu")
    for a in (act, projector_act):
        if a not in _HF_HIDDEN_ACTS:
            raise ValueError(f"vision activation {a!r} is not supported; expected one of {sorted(_HF_HIDDEN_ACTS)}")
    return VisionConfig(
        model_type=vc.get("model_type") or "siglip_vision_model",
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=int(need("num_attention_heads")),
        image_size=int(need("image_size")),
        patch_size=int(need("patch_size")),
        num_channels=int(vc.get("num_channels", 3)),
        layer_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
        hidden_act=_HF_HIDDEN_ACTS[act],
        image_token_id=raw.get("image_token_index", raw.get("image_token_id")),
        video_token_id=raw.get("video_token_index", raw.get("video_token_id")),
        feature_layer=tuple(feature_layer) if isinstance(feature_layer, (list, tuple)) else int(feature_layer),
        feature_select_strategy=raw.get("vision_feature_select_strategy", "default"),
        projector_hidden_act=_HF_HIDDEN_ACTS[projector_act],
        image_grid_pinpoints=tuple((int(h), int(w)) for h, w in raw.get("image_grid_pinpoints") or ()),
        vision_aspect_ratio=raw.get("vision_aspect_ratio"),
    )


def _parse_quantization(qc: Optional[dict]) -> Optional[QuantizationSpec]:
    if not qc:
        return None
    if not qc.get("quant_method"):
        raise ValueError("quantization_config has no 'quant_method'")
    if qc["quant_method"] == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    block = qc.get("weight_block_size")
    return QuantizationSpec(method=str(qc["quant_method"]), activation_scheme=qc.get("activation_scheme"),
                            weight_block_size=tuple(int(b) for b in block) if block else None,
                            ignored_layers=tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()))


def _parse_compressed_tensors(qc: dict) -> QuantizationSpec:
    """compressed-tensors configs: FP8 weights (float-quantized, 8-bit float in every config group) read as "fp8";
    anything else keeps the name "compressed-tensors/<format>", which no linear method takes."""
    fmt = qc.get("format") or "unknown"
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if (fmt not in ("float-quantized", "naive-quantized") or not groups
            or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights)):
        return QuantizationSpec(method=f"compressed-tensors/{fmt}")
    inputs = [g.get("input_activations") or {} for g in groups]
    static = any(i and not i.get("dynamic", False) for i in inputs)
    block = next((w.get("block_structure") for w in weights if w.get("strategy") == "block"), None)
    if any(w.get("strategy") == "block" for w in weights) and not block:
        raise ValueError("compressed-tensors weights with strategy 'block' need a block_structure")
    return QuantizationSpec(method="fp8", activation_scheme="static" if static else "dynamic",
                            weight_block_size=tuple(int(b) for b in block) if block else None,
                            ignored_layers=tuple(qc.get("ignore") or ()))
