"""GGUF files: config from metadata, tensors dequantized (any type the `gguf` package handles) to HF names."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
from typing import Iterator

import numpy as np
import torch

_LLAMA_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma-2's sandwich norms (llama.cpp's names: ffn_norm is the norm before the MLP here, after attention in Llama)
_GEMMA2_BLOCK_NAMES = {
    **_LLAMA_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_BLOCK_NAMES = {**_GEMMA2_BLOCK_NAMES, **_QK_NORM_NAMES}
# general.architecture -> (HF architecture, HF model_type, block tensor names)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", _LLAMA_BLOCK_NAMES),
    "mistral": ("LlamaForCausalLM", "llama", _LLAMA_BLOCK_NAMES),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", _LLAMA_BLOCK_NAMES),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES}),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", _GEMMA2_BLOCK_NAMES),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", _GEMMA3_BLOCK_NAMES),
}
_GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")  # RMSNorm weights stored as 1 + w
# HF Gemma2Config's soft-caps, for a GGUF that does not state them (llama.cpp's converter writes both)
_GEMMA2_DEFAULT_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    """One parsed reader per file while its conversions (config, weights, tokenizer) run: parsing costs 11 s and holds
    ~0.7 GB for Gemma-3's 262k-token vocabulary (release_gguf_readers drops it)."""
    from gguf.gguf_reader import GGUFReader  # the class itself, never the name swapped below

    return GGUFReader(path)


def release_gguf_readers() -> None:
    """Drop the parsed readers once a process has loaded its model and tokenizer (what they served is on disk)."""
    _reader.cache_clear()


_READER_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def transformers_reads_through_braids_reader(path: str):
    """Inside this block transformers' `gguf.GGUFReader(path)` (it builds its own reader, then parses every metadata
    field: 11 s for Gemma-3's 262k-token vocabulary) is braid's cached reader of the same file; other files and
    other arguments still get a reader of their own. gguf.GGUFReader is restored on leaving."""
    import gguf

    target = os.path.realpath(path)
    with _READER_SWAP_LOCK:
        own_reader = gguf.GGUFReader

        def reader(file, *args, **kwargs):
            if not args and not kwargs and os.path.realpath(file) == target:
                return _reader(path)
            return own_reader(file, *args, **kwargs)

        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = own_reader


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(path: str) -> dict:
    """An HF-style config dict (LlamaConfig fields) read from the GGUF metadata (cached: parsing all metadata is slow)."""
    import json

    from braid.runtime.loader.cache import cached_dir

    def convert(out_dir: str) -> None:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(_read_gguf_config(path), f, indent=1)

    with open(os.path.join(cached_dir(path, "gguf-config", convert), "config.json")) as f:
        return json.load(f)


def _read_gguf_config(path: str) -> dict:
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture '{arch}' is not supported ({', '.join(_ARCHITECTURES)})")
    hf_architecture, model_type, _ = _ARCHITECTURES[arch]

    def g(name, default=None):
        return _field(r, f"{arch}.{name}", default)

    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    names = {t.name for t in r.tensors}
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(_field(r, "tokenizer.ggml.tokens"))
    cfg = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon",
                                1e-6 if model_type in _GEMMA_MODEL_TYPES else 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "attention_bias": arch == "qwen2",
        "torch_dtype": "float32",
    }
    if arch == "gemma2":
        cfg.update(_gemma2_config(g, cfg))
    if arch == "gemma3":
        cfg.update(_gemma3_config(g, cfg))
    return cfg


def _gemma_attention(g, cfg: dict, largest_model_layers: int) -> dict:
    """The window, query scale and activation of a Gemma GGUF. GGUF has no key for the scale; llama.cpp's rule is
    1/sqrt(hidden / heads) for the largest model (Gemma-2 27B: 46 layers, 144 = 4608 / 32; Gemma-3 27B: 62 layers,
    168 = 5376 / 32) and 1/sqrt(head_dim) otherwise, which is what query_pre_attn_scalar says in every released
    config."""
    window = g("attention.sliding_window")
    largest = cfg["num_hidden_layers"] == largest_model_layers
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if largest else cfg["head_dim"]
    return {"sliding_window": int(window) if window is not None else None, "query_pre_attn_scalar": scalar,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh"}


def _gemma2_config(g, cfg: dict) -> dict:
    """What a Gemma-2 GGUF adds: window, soft-caps, activation and the query scale."""
    caps = {key: float(g(key, default)) for key, default in _GEMMA2_DEFAULT_CAPS.items()}
    return {**_gemma_attention(g, cfg, 46), **caps}


def _gemma3_config(g, cfg: dict) -> dict:
    """What a Gemma-3 GGUF adds, with llama.cpp's implicit rules: the window on five layers of every six (unless the
    file states the pattern), window layers' rope theta 10,000 unscaled, the global layers' rope as stated (linear
    scaling in the larger models), the query scale as for Gemma-2 (the largest model has 62 layers); no soft-caps."""
    pattern = int(g("attention.sliding_window_pattern", 6))
    layers = cfg["num_hidden_layers"]
    out = {**_gemma_attention(g, cfg, 62), "attn_logit_softcapping": None, "final_logit_softcapping": None,
           "rope_local_base_freq": 10000.0,
           "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]}
    scaling_type, factor = g("rope.scaling.type"), g("rope.scaling.factor")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"Gemma-3 GGUF rope scaling {scaling_type!r} is not supported (linear only)")
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return out


def _hf_name(name: str, block_names: dict) -> str:
    if name in _LLAMA_TENSOR_NAMES:
        return _LLAMA_TENSOR_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in block_names:
        raise ValueError(f"unexpected GGUF tensor {name}")
    return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter interleaves q/k rows for its rope layout; HF keeps halves: undo it.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(t) -> torch.Tensor:
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
    name = t.tensor_type.name
    if name in ("F32", "F16", "BF16"):
        arr = np.asarray(t.data)
        out = torch.from_numpy(arr.copy()) if name != "BF16" else torch.from_numpy(arr.copy()).view(torch.bfloat16)
        return out.float().reshape(shape)
    arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(arr)).reshape(shape)


def iter_gguf_tensors(path: str, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    r = _reader(path)
    model_type = config["model_type"]
    permute = model_type == "llama"
    block_names = _ARCHITECTURES[_field(r, "general.architecture")][2]
    for t in r.tensors:
        hf = _hf_name(t.name, block_names)
        arr = dequantize_tensor(t)
        if model_type in _GEMMA_MODEL_TYPES and hf.endswith("norm.weight"):
            arr = arr - 1  # llama.cpp stores Gemma's RMSNorm weight w as 1 + w (its norm multiplies by the weight)
        elif permute and hf.endswith("q_proj.weight"):
            arr = _unpermute_rope(arr, config["num_attention_heads"])
        elif permute and hf.endswith("k_proj.weight"):
            arr = _unpermute_rope(arr, config["num_key_value_heads"])
        yield hf, arr.contiguous()


def gguf_dequantized_dir(path: str, config: dict) -> str:
    """A folder holding the GGUF's tensors dequantized, under HF names, as safetensors (made on first use)."""
    from safetensors.torch import save_file

    from braid.runtime.loader.cache import cached_dir

    def convert(out_dir: str) -> None:
        started = time.perf_counter()
        logger.info("first use of %s: dequantizing %d GGUF tensors into the cache (once)", path,
                    len(_reader(path).tensors))
        save_file(dict(iter_gguf_tensors(path, config)), os.path.join(out_dir, "model.safetensors"))
        logger.info("dequantized in %.1f s", time.perf_counter() - started)

    return cached_dir(path, "gguf-dequantized", convert)


def iter_gguf_tensors_cached(path: str, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Same tensors as iter_gguf_tensors, read from a dequantized safetensors copy made on first use."""
    from braid.runtime.loader.hf import iter_safetensors

    return iter_safetensors(gguf_dequantized_dir(path, config))
