"""Shared decoder blocks, shaped by ModelConfig's LayerSpec / RopeSpec. A family composes these and adds only what
is its own; module names follow HF's checkpoints (`self_attn.qkv_proj` loads `q_proj`/`k_proj`/`v_proj`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers.activation import GeluAndMul, SiluAndMul
from braid.runtime.layers.embedding import LMHead, VocabEmbedding
from braid.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear, norm_linear_act
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.radix_attention import RadixAttention
from braid.runtime.layers.rotary import get_rope
from braid.runtime.loader.model_config import LayerSpec, ModelConfig, RopeSpec
from braid.runtime.models.base import CausalLM

# (fused param, HF name, shard) rows for CausalLM.load_weights
QKV_STACKED_PARAMS = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2)]
GATE_UP_STACKED_PARAMS = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


def tensor_parallel_heads(layer_id: int, spec: LayerSpec) -> tuple[int, int, int, int]:
    """This TP rank's (first query head, query heads, first KV head, KV heads). With at least as many KV heads as
    ranks, each rank takes whole KV groups (unevenly when they do not divide: SmolLM2's 3 over 2 ranks) with their
    query heads; with fewer, the query heads split evenly and each rank keeps the one KV head they attend to."""
    kv_first, kv_count = ps.split_units(spec.num_kv_heads, f"layer {layer_id}'s KV heads")
    if spec.num_kv_heads >= ps.tp_size():
        group = spec.num_heads // spec.num_kv_heads
        return kv_first * group, kv_count * group, kv_first, kv_count
    if spec.num_heads % ps.tp_size():
        raise ValueError(f"layer {layer_id}'s {spec.num_heads} attention heads do not split over "
                         f"tp_size={ps.tp_size()}")
    per_rank = spec.num_heads // ps.tp_size()
    return ps.tp_rank() * per_rank, per_rank, kv_first, kv_count


class Attention(nn.Module):
    """qkv projection -> (q/k head norms) -> rotary -> paged attention -> o projection, for one multi-head (MHA/GQA)
    layer. `rope` is the model's; a LayerSpec with its own (Gemma-3's window layers) overrides it."""

    def __init__(self, layer_id: int, spec: LayerSpec, rope: RopeSpec, hidden_size: int, qkv_bias: bool = False,
                 out_bias: bool = False, rms_norm_eps: float = 1e-6, norm_unit_offset: bool = False):
        super().__init__()
        if spec.attention != "mha":
            raise ValueError(f"layer {layer_id} is {spec.attention!r} attention; this block builds 'mha' layers")
        q_first, self.num_heads, kv_first, self.num_kv_heads = tensor_parallel_heads(layer_id, spec)
        self.q_size = self.num_heads * spec.head_dim
        self.k_size = self.num_kv_heads * spec.head_dim
        self.v_size = self.num_kv_heads * spec.v_head_dim
        self.qkv_proj = ColumnParallelLinear(hidden_size, [spec.num_heads * spec.head_dim,
                                                           spec.num_kv_heads * spec.head_dim,
                                                           spec.num_kv_heads * spec.v_head_dim], bias=qkv_bias,
                                             shard_ranges=[(q_first * spec.head_dim, self.q_size),
                                                           (kv_first * spec.head_dim, self.k_size),
                                                           (kv_first * spec.v_head_dim, self.v_size)])
        self.o_proj = RowParallelLinear(spec.num_heads * spec.v_head_dim, hidden_size, bias=out_bias,
                                        shard_range=(q_first * spec.v_head_dim, self.num_heads * spec.v_head_dim))
        rope = spec.rope or rope
        self.rotary_emb = get_rope(spec.head_dim, rope.rotary_dim, rope.max_position, rope.theta, rope.scaling_dict(),
                                   rope.is_neox_style)
        self.head_dim = spec.head_dim
        self.q_norm = RMSNorm(spec.head_dim, rms_norm_eps, norm_unit_offset) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, rms_norm_eps, norm_unit_offset) if spec.qk_norm else None
        self.attn = RadixAttention(layer_id, self.num_heads, spec.head_dim, self.num_kv_heads, scaling=spec.scaling,
                                   sliding_window=spec.sliding_window or -1, logit_cap=spec.logit_cap,
                                   v_head_dim=spec.v_head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb) -> torch.Tensor:
        # hidden: [T, hidden], normed -> [T, hidden]. At decode rotary and the KV write are the qkv matmul's
        # epilogue (one launch with it at batch 1 where the pool allows)
        store = None if self.q_norm is not None else self.attn.rotary_kv_store(fb, positions, self.rotary_emb)
        if store is None:
            return self.attend(positions, self.qkv_proj(hidden), fb)
        return self.o_proj(self.attn(self.qkv_proj(hidden, store), None, None, fb, save_kv_cache=False))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, fb) -> torch.Tensor:
        # qkv: [T, H*D + Hkv*D + Hkv*Dv], the qkv_proj output -> [T, hidden]
        q, k, v = qkv.split([self.q_size, self.k_size, self.v_size], dim=-1)
        if self.q_norm is not None:  # per head: [T * H, D] rows
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape[0], -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape[0], -1)
        return self.o_proj(self.attn(q, k, v, fb, rotary=self.rotary_emb, positions=positions))


def gated_activation(hidden_act: str) -> nn.Module:
    if hidden_act == "silu":
        return SiluAndMul()
    if hidden_act == "gelu_tanh":
        return GeluAndMul("tanh")
    if hidden_act == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"no gated activation for hidden_act {hidden_act!r}")


class GatedMLP(nn.Module):
    """down(act(gate) * up): one fused gate_up projection, a gated activation, the down projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act = gated_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the activation goes into the gate_up matmul, fused where the linear method can (the batch-1 GEMV)
        return self.down_proj(self.gate_up_proj(x, self.act))


def attention_and_mlp(layer_id: int, spec: LayerSpec, config: ModelConfig,
                      norm_unit_offset: bool = False) -> tuple[Attention, GatedMLP]:
    """One layer's MHA/GQA attention and gated MLP as the config describes them (biases, activation, rope, q/k
    norms; `norm_unit_offset`: the family's norms multiply by 1 + weight)."""
    attention = Attention(layer_id, spec, config.rope, config.hidden_size, qkv_bias=config.attention_bias,
                          out_bias=config.attention_out_bias, rms_norm_eps=config.rms_norm_eps,
                          norm_unit_offset=norm_unit_offset)
    return attention, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)


class PreNormDecoderLayer(nn.Module):
    """hidden + attn(norm(hidden)), then + mlp(norm(...)); the residual sum travels with the next norm."""

    def __init__(self, self_attn: Attention, mlp: GatedMLP, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor], fb):
        # the MLP's activation runs inside the gate_up matmul where the linear method fuses it (the batch-1 GEMV)
        if residual is None:
            x, residual = self.input_layernorm(hidden), hidden
        else:
            x, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, x, fb)
        hidden, residual = norm_linear_act(self.mlp.gate_up_proj, hidden, self.post_attention_layernorm, residual,
                                           self.mlp.act)
        return self.mlp.down_proj(hidden), residual


class DecoderModel(nn.Module):
    """Token embedding, the decoder layers, the final norm: input ids -> final-normed hidden [T, hidden]."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], embed_scale: Optional[float] = None,
                 norm_unit_offset: bool = False):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, scale=embed_scale)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, add_unit_offset=norm_unit_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb,
                input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        capture = getattr(fb, "aux_hidden_layers", None)  # EAGLE-3: these layers' input residual streams
        captured = {}
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture:
                # a clone: fused norms may update the residual stream in place later
                captured[i] = hidden.clone() if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, fb)
        if capture is not None:
            fb.aux_hidden = torch.cat([captured[i] for i in capture], dim=-1)  # [T, len(capture) * hidden]
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @classmethod
    def captures_aux_hidden(cls) -> bool:
        """Whether forward fills ForwardBatch.aux_hidden (a subclass with its own forward does not)."""
        return cls.forward is DecoderModel.forward


class DecoderForCausalLM(CausalLM):
    """A DecoderModel and its LM head (tied to the embedding when the config says so); families give build_layer.

    Gemma-style families set `scale_embeddings` (embedding rows times sqrt(hidden)) and `norm_unit_offset` (the
    final norm multiplies by 1 + weight)."""

    scale_embeddings = False
    norm_unit_offset = False
    decoder_model = DecoderModel  # a family whose layers hand a different state along subclasses it

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.model_config = config
        self.model = self.decoder_model(config, [self.build_layer(i, spec) for i, spec in enumerate(config.layers)],
                                        embed_scale=config.hidden_size ** 0.5 if self.scale_embeddings else None,
                                        norm_unit_offset=self.norm_unit_offset)
        self.tie_word_embeddings = config.tie_word_embeddings
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, logit_softcap=config.final_logit_softcap)

    def build_layer(self, layer_id: int, spec: LayerSpec) -> nn.Module:
        raise NotImplementedError

    def forward(self, fb, input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(fb.input_ids, fb.positions, fb, input_embeds)

    def post_load(self, device, dtype) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        super().post_load(device, dtype)
