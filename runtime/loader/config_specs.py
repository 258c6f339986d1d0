"""The typed parts of ModelConfig: per-layer attention, rope, MLA, MoE, vision tower, quantization."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

AttentionKind = Literal["mha", "mla"]
ROPE_SCALING_TYPES = ("none", "llama3", "linear", "yarn")
HIDDEN_ACTS = ("silu", "gelu_tanh", "gelu")
MOE_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int
    max_position: int
    scaling_type: str = "none"  # none | llama3 | linear | yarn
    factor: float = 1.0
    original_max_position: Optional[int] = None  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn
    mscale_all_dim: float = 0.0  # yarn; DeepSeek folds it into the softmax scale too
    is_neox_style: bool = True  # False: rotate interleaved pairs (DeepSeek)

    def __post_init__(self):
        if self.scaling_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope scaling type {self.scaling_type!r} is not supported; expected one of {ROPE_SCALING_TYPES}")
        if self.theta <= 0 or self.rotary_dim <= 0 or self.rotary_dim % 2 or self.max_position <= 0:
            raise ValueError(f"rope needs theta > 0, an even rotary_dim > 0 and max_position > 0; got {self}")
        if self.scaling_type != "none" and self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.scaling_type in ("llama3", "yarn") and self.original_max_position is None:
            raise ValueError(f"{self.scaling_type} rope scaling needs original_max_position_embeddings")

    def scaling_dict(self) -> Optional[dict]:
        """The scaling in HF's rope_scaling shape, as `get_rope` takes it; None without scaling."""
        if self.scaling_type == "none":
            return None
        out = {"rope_type": self.scaling_type, "factor": self.factor}
        if self.original_max_position is not None:
            out["original_max_position_embeddings"] = self.original_max_position
        if self.scaling_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.scaling_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, mscale=self.mscale,
                       mscale_all_dim=self.mscale_all_dim)
        return out


def yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's attention and MLP kind. MLA layers list the expanded (per-head) dims; the latent sizes
    are on `ModelConfig.mla`."""

    attention: AttentionKind
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q and k, per head
    v_head_dim: int
    scaling: float  # softmax scale
    sliding_window: Optional[int] = None
    logit_cap: float = 0.0
    is_moe: bool = False
    rope: Optional[RopeSpec] = None  # this layer's own rope (Gemma-3's window layers); None: ModelConfig.rope
    qk_norm: bool = False  # an RMSNorm over head_dim on each query and key head before rope (Gemma-3, Qwen3)

    def __post_init__(self):
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention kind must be 'mha' or 'mla', got {self.attention!r}")
        if min(self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim) <= 0:
            raise ValueError(f"head counts and dims must be positive: {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.logit_cap < 0 or self.scaling <= 0:
            raise ValueError(f"logit_cap must be >= 0 and scaling > 0: {self}")


@dataclass(frozen=True)
class MLASpec:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None  # None: q_proj is one dense matrix

    def __post_init__(self):
        if min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) <= 0:
            raise ValueError(f"MLA dims must be positive: {self}")


@dataclass(frozen=True)
class MoESpec:
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    topk_method: str = "greedy"
    n_group: Optional[int] = None  # group-limited routing: experts split into n_group groups,
    topk_group: Optional[int] = None  # tokens route within the best topk_group of them
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self):
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.n_routed_experts}")
        if self.topk_method not in MOE_TOPK_METHODS:
            raise ValueError(f"MoE topk_method {self.topk_method!r} is not supported; expected one of {MOE_TOPK_METHODS}")
        if self.topk_method != "greedy":
            if self.n_group is None or self.topk_group is None:
                raise ValueError(f"MoE topk_method {self.topk_method!r} needs n_group and topk_group")
            if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"MoE groups invalid: {self.n_routed_experts} experts, n_group {self.n_group}, "
                                 f"topk_group {self.topk_group}")
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
                raise ValueError(f"MoE top-{self.num_experts_per_tok} cannot come from {self.topk_group} groups of "
                                 f"{self.n_routed_experts // self.n_group} experts")
        if self.moe_intermediate_size <= 0 or self.n_shared_experts < 0 or self.moe_layer_freq <= 0:
            raise ValueError(f"MoE sizes invalid: {self}")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA-style vision tower (`vision_config`) and how its features enter the text model."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_tanh"
    image_token_id: Optional[int] = None
    video_token_id: Optional[int] = None
    feature_layer: Union[int, tuple[int, ...]] = -1
    feature_select_strategy: str = "default"  # default: drop the CLS token; full: keep every token
    projector_hidden_act: str = "gelu"
    image_grid_pinpoints: tuple[tuple[int, int], ...] = ()
    vision_aspect_ratio: Optional[str] = None

    def __post_init__(self):
        if not 0 < self.patch_size <= self.image_size:
            raise ValueError(f"vision patch_size {self.patch_size} must be in 1..image_size ({self.image_size})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        if self.feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {self.feature_select_strategy!r}")
        if self.hidden_act not in HIDDEN_ACTS or self.projector_hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"vision activations must be among {HIDDEN_ACTS}: {self.hidden_act}, {self.projector_hidden_act}")


@dataclass(frozen=True)
class QuantizationSpec:
    method: str  # config.json quant_method, e.g. "fp8"
    activation_scheme: Optional[str] = None  # dynamic | static
    weight_block_size: Optional[tuple[int, int]] = None  # None: per-tensor or per-channel scales
    ignored_layers: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.method:
            raise ValueError("quantization_config.quant_method is empty")
        if self.weight_block_size is not None and (len(self.weight_block_size) != 2 or min(self.weight_block_size) <= 0):
            raise ValueError(f"weight_block_size must be two positive ints, got {self.weight_block_size}")
