"""SigLIP vision tower (HF `SiglipVisionModel` layout), up to the hidden state a LLaVA-style model selects.

Runs non-causal attention over each tile's patches with SDPA; tiles from every image and frame of a batch go
through in one call. Layers past the selected one, the post-layernorm and the pooling head are not built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from braid.runtime.loader.config_specs import VisionConfig


def vision_layers_needed(vision: VisionConfig) -> int:
    """Encoder layers to run so that hidden state `feature_layer` (0 = the embeddings, -1 = the last layer's output,
    HF's `hidden_states` indexing) is the last one computed."""
    layers = vision.feature_layer if isinstance(vision.feature_layer, tuple) else (vision.feature_layer,)
    total = vision.num_hidden_layers
    indices = [i if i >= 0 else total + 1 + i for i in layers]
    if any(not 0 <= i <= total for i in indices):
        raise ValueError(f"vision_feature_layer {vision.feature_layer} is outside 0..{total}")
    return max(indices)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(vision.num_channels, vision.hidden_size, vision.patch_size,
                                         stride=vision.patch_size)
        self.position_embedding = nn.Embedding((vision.image_size // vision.patch_size) ** 2, vision.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [N, C, S, S] -> [N, G*G, D]
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight[None]


class SiglipAttention(nn.Module):
    """Under tensor parallelism each rank holds num_heads / tp heads (q, k and v column-split, out row-split)."""

    def __init__(self, vision: VisionConfig):
        super().__init__()
        d = vision.hidden_size
        self.head_dim = d // vision.num_attention_heads
        self.qkv_proj = ColumnParallelLinear(d, [d, d, d], bias=True)
        self.num_heads = self.qkv_proj.output_sizes[0] // self.head_dim  # this rank's heads
        self.out_proj = RowParallelLinear(d, d, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, L, D] -> q, k, v: [N, L, heads, Dh]
        n, length, d = x.shape
        qkv = self.qkv_proj(x.reshape(n * length, d))
        q, k, v = qkv.view(n, length, 3, self.num_heads, self.head_dim).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out_proj(out.transpose(1, 2).reshape(n * length, self.num_heads * self.head_dim)).view(n, length, d)


class SiglipMLP(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.fc1 = ColumnParallelLinear(vision.hidden_size, [vision.intermediate_size], bias=True)
        self.fc2 = RowParallelLinear(vision.intermediate_size, vision.hidden_size, bias=True)
        self.approximate = "tanh" if vision.hidden_act == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, L, D]
        flat = x.reshape(-1, x.shape[-1])
        return self.fc2(F.gelu(self.fc1(flat), approximate=self.approximate)).view(x.shape)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.self_attn = SiglipAttention(vision)
        self.layer_norm2 = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.mlp = SiglipMLP(vision)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, vision: VisionConfig, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(vision) for _ in range(num_layers))


class SiglipVisionTower(nn.Module):
    """pixels [N, C, S, S] -> the selected hidden state(s), concatenated on the feature dim: [N, G*G, D * k]."""

    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.vision = vision
        self.embeddings = SiglipVisionEmbeddings(vision)
        self.encoder = SiglipEncoder(vision, vision_layers_needed(vision))
        layers = vision.feature_layer if isinstance(vision.feature_layer, tuple) else (vision.feature_layer,)
        self.selected = [i if i >= 0 else vision.num_hidden_layers + 1 + i for i in layers]

    def wants_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor (name relative to the tower) belongs to a part this tower builds."""
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) < len(self.encoder.layers)
        return name.startswith("embeddings.")

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixels)
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return torch.cat([states[i] for i in self.selected], dim=-1)
