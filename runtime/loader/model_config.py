"""ModelConfig: the few derived facts the runtime needs, plus the raw HF config for the model class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    hf: dict
    path: Optional[str]
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    v_head_dim: int
    hidden_size: int
    vocab_size: int
    context_len: int
    eos_token_ids: tuple
    attention_arch: str = "mha"  # "mha" or "mla"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_tensors_hint: Optional[int] = None

    @classmethod
    def from_hf(cls, raw: dict, server_args, path: Optional[str]) -> "ModelConfig":
        text = raw.get("text_config") or raw
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        ctx = server_args.context_length or text.get("max_position_embeddings", 4096)
        is_mla = "kv_lora_rank" in text and text.get("kv_lora_rank") is not None
        return cls(
            hf=raw,
            path=path,
            architecture=archs[0],
            num_layers=text["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads") or heads,
            head_dim=(text.get("kv_lora_rank", 0) + text.get("qk_rope_head_dim", 0)) if is_mla else head_dim,
            v_head_dim=text.get("kv_lora_rank", 0) if is_mla else head_dim,
            hidden_size=text["hidden_size"],
            vocab_size=text["vocab_size"],
            context_len=int(ctx),
            eos_token_ids=eos,
            attention_arch="mla" if is_mla else "mha",
            kv_lora_rank=text.get("kv_lora_rank") or 0,
            qk_rope_head_dim=text.get("qk_rope_head_dim") or 0,
            num_tensors_hint=None,
        )

    def torch_dtype(self, requested: str, device: str) -> torch.dtype:
        if requested != "auto":
            return _DTYPES[requested]
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
