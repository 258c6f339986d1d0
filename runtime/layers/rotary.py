"""Rotary position embeddings (neox half-split or interleaved pairs), with llama3 / linear / yarn scalings."""

from __future__ import annotations

import json
import math
from typing import Optional

import torch
from torch import nn

from braid.runtime.loader.config_specs import yarn_mscale


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, rotary_dim: int, base: float) -> tuple[torch.Tensor, float]:
    """YaRN as HF transformers computes it (DeepSeek's yarn too): per pair, blend the interpolated (inv_freq / factor)
    and the original frequency by a linear ramp over the pairs between the beta_fast and beta_slow rotation counts.
    -> (inv_freq, attention factor that cos and sin are multiplied by)."""
    factor = scaling["factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32.0, scaling.get("beta_slow") or 1.0

    def pair_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times into old_ctx
        return rotary_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_of(beta_fast)), 0)
    high = min(math.ceil(pair_of(beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor, 1.0)
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: Optional[dict] = None, is_neox_style: bool = True):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        self.is_neox_style = is_neox_style
        # the cache is built in post_load (never on meta)
        self.cos_sin_cache: Optional[torch.Tensor] = None

    def build_cache(self, device, built: Optional[dict] = None) -> None:
        """cos_sin_cache on `device`; built: (what the cache depends on, device) -> a cache already built for another
        layer, taken if there (Gemma-3-270M's 18 layers hold 2 distinct 32 MB caches), else filled with this one."""
        key = (self.rotary_dim, self.max_position, self.base, json.dumps(self.scaling, sort_keys=True),
               torch.device(device))
        if built is not None and key in built:
            self.cos_sin_cache = built[key]
            return
        self._compute_cache(device)
        if built is not None:
            built[key] = self.cos_sin_cache

    def _compute_cache(self, device) -> None:
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device="cpu") / self.rotary_dim))
        rope_type = (self.scaling or {}).get("rope_type", (self.scaling or {}).get("type"))
        max_pos = self.max_position
        attention_factor = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / self.scaling["factor"]
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(inv_freq, self.scaling, self.rotary_dim, self.base)
        elif rope_type not in (None, "default"):
            raise ValueError(f"rope scaling {rope_type!r} is not built yet (supported: llama3, linear, yarn)")
        t = torch.arange(max_pos, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # [max_pos, rotary_dim]: cos half then sin half (yarn: both times its attention factor)
        self.cos_sin_cache = (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor).to(
            device=device, dtype=torch.float32)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, H*D]; k: [T, Hkv*D]
        if q.is_cuda:
            # one fused launch that rotates q and k in place (they are views into the qkv output)
            from braid.runtime.layers import rotary_kernels

            if self.cos_sin_cache is None:
                raise RuntimeError("RotaryEmbedding.build_cache must run before forward")
            q, k = rotary_kernels.apply_rotary(positions, q, k, self.cos_sin_cache, self.head_dim,
                                               self.rotary_dim, self.is_neox_style, inplace=True)
            tokens = positions.shape[0]
            return q.reshape(tokens, -1), k.reshape(tokens, -1)
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The PyTorch reference (CPU path); returns new tensors."""
        cs = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cs.chunk(2, dim=-1)  # [T, rd/2]
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        x = x.view(T, -1, self.head_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        rf = rot.float()
        if self.is_neox_style:
            x1, x2 = rf.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rf[..., 0::2], rf[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        out = out.to(x.dtype)
        if rest.shape[-1]:
            out = torch.cat([out, rest], dim=-1)
        return out.reshape(T, -1)


def get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float, scaling: Optional[dict] = None,
             is_neox_style: bool = True) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, scaling, is_neox_style)
