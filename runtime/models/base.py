"""Shared weight-loading mechanics for models built on `meta`."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from braid.runtime.layers.rotary import RotaryEmbedding


class CausalLM(nn.Module):
    """Base for braid's model classes.

    Contract: `forward(fb) -> hidden [T, hidden]` (final-normed), `lm_head(hidden) -> logits fp32`,
    `load_weights(iter of (hf_name, tensor), device)` and `post_load(device, dtype)` (build caches, tie weights).
    Subclasses define `stacked_params`: (fused_param_suffix, hf_suffix, shard_id) rows.
    """

    stacked_params: list[tuple[str, str, int]] = []
    skip_prefixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def _materialize(self, module: nn.Module, attr: str, device, dtype) -> nn.Parameter:
        p = getattr(module, attr)
        if p.is_meta:
            p = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=False)
            setattr(module, attr, p)
        return p

    def _resolve(self, name: str):
        module_path, _, attr = name.rpartition(".")
        return self.get_submodule(module_path), attr

    def fused_name(self, name: str) -> tuple[str, Optional[int]]:
        """A checkpoint name -> (the parameter's name here, its shard in a fused projection or None)."""
        for fused, hf, sid in self.stacked_params:
            if hf in name:
                return name.replace(hf, fused), sid
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], device) -> None:
        for name, loaded in weights:
            if any(s in name for s in self.skip_prefixes):
                continue
            if name == "lm_head.weight" and getattr(self, "tie_word_embeddings", False):
                continue
            name, shard_id = self.fused_name(name)
            try:
                module, attr = self._resolve(name)
            except AttributeError:
                raise ValueError(f"checkpoint tensor {name} has no place in {type(self).__name__}") from None
            method = getattr(module, "linear_method", None)
            if method is not None and method.load_weight(module, attr, loaded, shard_id, device):
                continue
            param = self._materialize(module, attr, device, loaded.dtype)
            if shard_id is not None:
                sizes = module.output_sizes
                offset = sum(sizes[:shard_id])
                part = module.load_shard(param, loaded, shard_id) if loaded.dim() >= 1 else loaded
                param.data.narrow(0, offset, sizes[shard_id]).copy_(part)
            else:
                if hasattr(module, "load_shard"):
                    loaded = module.load_shard(param, loaded)
                if param.shape != loaded.shape:
                    raise ValueError(f"shape mismatch for {name}: model {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
                param.data.copy_(loaded)

    def post_load(self, device, dtype) -> None:
        rotary_caches: dict = {}  # layers whose rotary parameters are equal share one cos/sin tensor
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.build_cache(device, built=rotary_caches)
            elif hasattr(m, "build_cache"):
                m.build_cache(device)
        self.prepack_weights()

    def prepack_weights(self) -> None:
        """Re-lay-out matmul weights for the device's fast path (CPU: oneDNN); call again after changing weights."""
        for m in self.modules():
            if m is not self and hasattr(m, "prepack_weights"):
                m.prepack_weights()
