"""EAGLE and EAGLE-3 draft heads, read from their published checkpoint layouts (config.json + *.safetensors).

EAGLE (1 and 2): `fc` [H, 2H] (+ bias) fuses the embedding of a token with the target's final hidden state at the
position before it; `layers.N.*` are Llama decoder layers, the first without its input norm; the target's LM head
reads the output (no final norm). EAGLE-3: `fc` [H, 3 * H_target] fuses three of the target's layers' hidden states;
one decoder layer `midlayer.*` whose attention reads [input_layernorm(embedding), hidden_norm(fused)] (2H wide), its
own final `norm` and `lm_head` over a reduced draft vocabulary, and `d2t` (draft id -> target id offset).

This module is the head's math and its loading: `forward` is dense causal attention over one sequence (the
reference); `extend` and `draft` run a `HeadBatch` of several requests at once (head_batch.py: one attention call a
layer over the requests' head KV, head_kv.py), the catch-up rows and then each depth of the drafts
(runtime/speculative/eagle.py drives it).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.norm import RMSNorm
from braid.runtime.layers.rotary import get_rope
from braid.runtime.loader.hf import hf_config, iter_safetensors
from braid.runtime.speculative.head_batch import HeadBatch
from braid.runtime.speculative.head_kv import HeadKVCache, HeadKVPool


@dataclass(frozen=True)
class EagleHeadConfig:
    kind: str  # "EAGLE" or "EAGLE3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # EAGLE3's lm_head rows (= vocab_size without a reduced vocabulary)
    fc_in: int  # EAGLE: 2 * hidden; EAGLE3: 3 * the target's hidden size
    fc_bias: bool

    @classmethod
    def from_checkpoint(cls, cfg: dict, shapes: dict[str, tuple]) -> "EagleHeadConfig":
        """cfg: config.json; shapes: the checkpoint's tensor names (without a 'model.' prefix) -> shapes."""
        if "fc.weight" not in shapes:
            raise ValueError("not an EAGLE draft head: the checkpoint has no fc.weight")
        kind = "EAGLE3" if any(n.startswith("midlayer.") for n in shapes) else "EAGLE"
        archs = " ".join(cfg.get("architectures") or [])
        if "Eagle3" in archs and kind != "EAGLE3":
            raise ValueError(f"config.json names {archs} but the weights are not EAGLE-3's (no midlayer.*)")
        H = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        layers = 1 if kind == "EAGLE3" else 1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("layers."))
        return cls(kind=kind, hidden_size=H, num_layers=layers, num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or H // heads,
                   intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                   rope_theta=cfg.get("rope_theta", 10000.0), rope_scaling=cfg.get("rope_scaling"),
                   max_position=cfg.get("max_position_embeddings", 4096), vocab_size=cfg["vocab_size"],
                   draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
                   fc_in=shapes["fc.weight"][1], fc_bias="fc.bias" in shapes)


class _Attention(nn.Module):
    def __init__(self, c: EagleHeadConfig, in_features: int):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(in_features, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.rotary = get_rope(c.head_dim, c.head_dim, c.max_position, c.rope_theta, c.rope_scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: Optional[tuple[HeadBatch, int]] = None):
        # x: [T, in_features]; positions: [T] -> [T, hidden]. kv None: causal over the T tokens of one sequence;
        # else (batch, this layer's index): the batch's current pass, over each request's head KV (head_batch.py)
        c, T = self.c, x.shape[0]
        q, k = self.rotary(positions, self.q_proj(x), self.k_proj(x))  # on CUDA one fused launch, in place
        q = q.view(T, c.num_heads, c.head_dim)
        k = k.view(T, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(T, c.num_kv_heads, c.head_dim)
        if kv is None:
            group = c.num_heads // c.num_kv_heads
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T, hd]
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)  # [T, heads, hd]
        else:
            batch, layer = kv
            out = batch.attend(layer, q, k, v)  # [T, heads, hd]
        return self.o_proj(out.reshape(T, -1))


class _MLP(nn.Module):
    def __init__(self, c: EagleHeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A Llama decoder layer; EAGLE's first has no input norm; EAGLE3's attends over [norm(emb), norm(hidden)]."""

    def __init__(self, c: EagleHeadConfig, input_norm: bool, eagle3: bool):
        super().__init__()
        self.eagle3 = eagle3
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps) if input_norm or eagle3 else None
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if eagle3 else None
        self.self_attn = _Attention(c, 2 * c.hidden_size if eagle3 else c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, embeds: Optional[torch.Tensor] = None,
                kv: Optional[tuple[HeadBatch, int]] = None):
        residual = x
        if self.eagle3:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        elif self.input_layernorm is not None:
            x = self.input_layernorm(x)
        x = self.self_attn(x, positions, kv) + residual
        return self.mlp(self.post_attention_layernorm(x)) + x


class EagleHead(nn.Module):
    def __init__(self, c: EagleHeadConfig, embed_tokens: nn.Module, target_lm_head: Optional[Callable] = None):
        super().__init__()
        self.c = c
        # the target's embedding (unless the checkpoint has its own) and LM head: used, not owned (kept out of this
        # module's parameters, so moving the head never moves the target's weights)
        self._shared = (embed_tokens, target_lm_head)
        self._pool: Optional[HeadKVPool] = None
        self.fc = nn.Linear(c.fc_in, c.hidden_size, bias=c.fc_bias)
        if c.kind == "EAGLE3":
            self.midlayer = _Layer(c, input_norm=True, eagle3=True)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            # draft id d is target id d + d2t[d]
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        else:
            self.layers = nn.ModuleList(_Layer(c, input_norm=i > 0, eagle3=False) for i in range(c.num_layers))
            if target_lm_head is None:
                raise ValueError("an EAGLE head reads its logits through the target's LM head; pass target_lm_head")

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """input_ids: [T] tokens 1..T of a sequence; hidden: [T, fc_in] the target's feature(s) at the position
        before each token (EAGLE: its final hidden state; EAGLE3: three layers' hidden states concatenated), or
        [T, hidden] the head's own output there (a later draft step); positions: [T].
        -> (logits [T, vocab_size] over the target's vocabulary, the head's hidden output [T, hidden])."""
        embed_tokens, target_lm_head = self._shared
        embeds = embed_tokens(input_ids)
        if self.c.kind == "EAGLE3":
            x = self.fc(hidden) if hidden.shape[-1] == self.c.fc_in else hidden
            out = self.midlayer(x, positions, embeds)
            return self._to_target_vocab(self.lm_head(self.norm(out))), out
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        for layer in self.layers:
            x = layer(x, positions)
        return target_lm_head(x), x

    @property
    def kv_pool(self) -> HeadKVPool:
        """Every request's head KV (made at first use: the loader moves the parameters after construction)."""
        if self._pool is None:
            c, w = self.c, self.fc.weight
            self._pool = HeadKVPool(c.num_layers, c.num_kv_heads, c.head_dim, w.device, w.dtype)
        return self._pool

    def new_cache(self, start: int = 0) -> HeadKVCache:
        return HeadKVCache(self.kv_pool, start)

    def batch(self, caches: list[HeadKVCache], rows: list[int], tokens: list[int], draft_steps: int = 0,
              width: int = 1) -> HeadBatch:
        """A pass over several requests (head_batch.py): request i's rows[i] >= 1 catch-up rows (input tokens
        `tokens`, flat on the host) appended to caches[i], then up to draft_steps depths of `width` rows each."""
        return HeadBatch(self.kv_pool, caches, rows, tokens, draft_steps, width)

    def extend(self, batch: HeadBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The batch's catch-up: hidden [T, fc_in] the target's feature(s) at the position before each row's token
        -> the head's hidden output [T, hidden]; the rows are appended to the caches."""
        out = self._run(batch, batch.input_ids, hidden, from_target=True)
        batch.commit()
        return out

    def draft(self, batch: HeadBatch, input_ids: torch.Tensor, hidden: torch.Tensor, depth: int,
              ancestors: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Depth `depth` (1..batch.draft_steps) of the batch's drafts: input_ids [P * width] each row's draft token
        (request by request), hidden [P * width, hidden] the head's output at its parent's row; ancestors
        [P, width, depth * width] bool: the draft rows (width a depth, in row order) each row attends to (a tree;
        None: a chain, every earlier depth) -> the head's hidden output [P * width, hidden]."""
        batch.set_depth(depth, ancestors)
        return self._run(batch, input_ids, hidden, from_target=False)

    def _run(self, batch: HeadBatch, input_ids: torch.Tensor, hidden: torch.Tensor, from_target: bool):
        # from_target: hidden is the target's feature(s), else the head's own output (EAGLE's fc takes either,
        # EAGLE-3's own outputs skip fc)
        embeds = self._shared[0](input_ids)
        if self.c.kind == "EAGLE3":
            x = self.fc(hidden) if from_target else hidden
            return self.midlayer(x, batch.positions, embeds, kv=(batch, 0))
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        for i, layer in enumerate(self.layers):
            x = layer(x, batch.positions, kv=(batch, i))
        return x

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] the head's outputs -> [N] int64 the target-vocabulary token each predicts (argmax;
        EAGLE-3: over its draft vocabulary, mapped through d2t)."""
        if self.c.kind == "EAGLE3":
            draft = self.lm_head(self.norm(hidden)).argmax(dim=-1)
            return draft + self.d2t[draft]
        return self._shared[1](hidden).argmax(dim=-1)

    def top_tokens(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [N, hidden] the head's outputs -> (probs [N, k] fp32, tokens [N, k] int64 target ids): the k
        likeliest next tokens under the head's distribution, likeliest first (EAGLE-3: its draft vocabulary's
        softmax, ids mapped through d2t)."""
        if self.c.kind == "EAGLE3":
            probs = torch.softmax(self.lm_head(self.norm(hidden)).float(), dim=-1)
            top, draft = probs.topk(k, dim=-1)
            return top, draft + self.d2t[draft]
        return torch.softmax(self._shared[1](hidden).float(), dim=-1).topk(k, dim=-1)

    def _to_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        # [T, draft_vocab] -> [T, vocab]: -inf where the draft vocabulary has no token
        out = draft_logits.new_full((draft_logits.shape[0], self.c.vocab_size), float("-inf"))
        targets = torch.arange(self.c.draft_vocab_size, device=draft_logits.device) + self.d2t
        out[:, targets] = draft_logits
        return out


def load_eagle_head(path: str, embed_tokens: nn.Module, target_lm_head: Optional[Callable], target_hidden_size: int,
                    target_vocab_size: int, device="cpu", dtype: torch.dtype = torch.float32,
                    max_position: Optional[int] = None) -> EagleHead:
    """The draft head in folder `path` (config.json, *.safetensors in EAGLE's or EAGLE-3's published names; a
    'model.' prefix is dropped), checked against the target: hidden sizes, vocabulary, every tensor present with its
    shape and nothing left over. ValueError names what does not fit. max_position: rotary tables at least this long
    (the target's context; the head's config may name a shorter one)."""
    if not os.path.isdir(path):
        raise ValueError(f"--speculative-draft-model-path {path!r} is not a folder")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors files (EAGLE checkpoints saved as pytorch_model.bin must be "
                         "converted; braid reads no pickled weights)")
    tensors = {(n[len("model."):] if n.startswith("model.") else n): t for n, t in iter_safetensors(path)}
    cfg = hf_config(path)
    c = EagleHeadConfig.from_checkpoint(cfg, {n: tuple(t.shape) for n, t in tensors.items()})
    if max_position is not None and max_position > c.max_position:
        c = replace(c, max_position=max_position)
    if c.vocab_size != target_vocab_size:
        raise ValueError(f"the draft head's vocab_size {c.vocab_size} is not the target's {target_vocab_size}")
    expected_fc = 3 * target_hidden_size if c.kind == "EAGLE3" else 2 * c.hidden_size
    if c.fc_in != expected_fc or (c.kind == "EAGLE" and c.hidden_size != target_hidden_size):
        raise ValueError(f"the draft head's fc takes {c.fc_in} features; a {c.kind} head over a target of hidden "
                         f"size {target_hidden_size} takes {expected_fc}")
    own_embed = tensors.pop("embed_tokens.weight", None)
    if own_embed is not None:
        embed_tokens = nn.Embedding(*own_embed.shape)
        embed_tokens.weight.data.copy_(own_embed)
    head = EagleHead(c, embed_tokens, target_lm_head)
    state = head.state_dict()
    missing = sorted(set(state) - set(tensors))
    unexpected = sorted(set(tensors) - set(state) - {"t2d"})  # t2d (target -> in draft vocab) is implied by d2t
    if missing or unexpected:
        raise ValueError(f"{path}: the {c.kind} layout lacks {missing or 'nothing'} and has unexpected "
                         f"{unexpected or 'nothing'}")
    for name, value in state.items():
        if tuple(tensors[name].shape) != tuple(value.shape):
            raise ValueError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, the {c.kind} layout of this "
                             f"config needs {tuple(value.shape)}")
        value.copy_(tensors[name])
    # parameter by parameter: Module.to would reach RotaryEmbedding, whose _apply is its own rotation
    for param in head.parameters():
        param.data = param.data.to(device=device, dtype=dtype)
    if c.kind == "EAGLE3":
        head.d2t = head.d2t.to(device)
    if own_embed is not None:
        embed_tokens.to(device=device, dtype=dtype)
    for module in head.modules():
        if isinstance(module, _Attention):
            module.rotary.build_cache(device)
    return head
