"""Llama family: Llama 2/3 (llama3 rope scaling), Mistral (sliding window), Qwen2 (qkv bias), SmolLM2 (tied embeddings)."""

from __future__ import annotations

import torch
from torch import nn

from braid.runtime.distributed import parallel_state as ps
from braid.runtime.layers.activation import SiluAndMul
from braid.runtime.layers.embedding import LMHead, VocabEmbedding
from braid.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear, norm_linear_act
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.radix_attention import RadixAttention
from braid.runtime.layers.rotary import get_rope
from braid.runtime.models.base import CausalLM


def rope_scaling_of(cfg: dict):
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return None
    return scaling


def rope_theta_of(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    return (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict, layer_id: int):
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        total_kv = cfg.get("num_key_value_heads") or total_heads
        tp = ps.tp_size()
        self.head_dim = cfg.get("head_dim") or hidden // total_heads
        self.num_heads = total_heads // tp
        self.num_kv_heads = max(1, total_kv // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = cfg.get("attention_bias", False) or cfg.get("model_type") == "qwen2"
        self.qkv_proj = ColumnParallelLinear(hidden, [total_heads * self.head_dim, total_kv * self.head_dim,
                                                      total_kv * self.head_dim], bias=bias)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=False)
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, cfg.get("max_position_embeddings", 4096),
                                   rope_theta_of(cfg), rope_scaling_of(cfg))
        sliding = cfg.get("sliding_window") if cfg.get("model_type") == "mistral" else None
        self.attn = RadixAttention(layer_id, self.num_heads, self.head_dim, self.num_kv_heads,
                                   scaling=self.head_dim ** -0.5, sliding_window=sliding or -1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), fb)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, fb) -> torch.Tensor:
        # qkv: [T, (H + 2 Hkv) * D], the qkv_proj output -> [T, hidden]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, fb, rotary=self.rotary_emb, positions=positions))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"])
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(self, positions, hidden, residual, fb):
        # each norm travels with the projection after it (one launch at decode batch 1, see norm_linear_act)
        qkv, residual = norm_linear_act(self.self_attn.qkv_proj, hidden, self.input_layernorm, residual)
        hidden = self.self_attn.attend(positions, qkv, fb)
        hidden, residual = norm_linear_act(self.mlp.gate_up_proj, hidden, self.post_attention_layernorm, residual,
                                           self.mlp.act)
        return self.mlp.down_proj(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, fb, input_embeds=None):
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    stacked_params = [
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, model_config):
        super().__init__()
        cfg = model_config.hf.get("text_config") or model_config.hf
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = LMHead(cfg["vocab_size"], cfg["hidden_size"])

    def forward(self, fb, input_embeds=None) -> torch.Tensor:
        return self.model(fb.input_ids, fb.positions, fb, input_embeds)

    def post_load(self, device, dtype) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        super().post_load(device, dtype)
