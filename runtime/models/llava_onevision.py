"""LLaVA-OneVision (HF `llava-onevision-*-ov-hf` layout): a SigLIP tower, a 2-layer projector and `image_newline`
in front of a Qwen2 text model (the Llama-family decoder of blocks.py).

In an extend pass the model runs the tower once over every tile and frame of the items that overlap the pass's new
tokens, projects them, arranges each item's features as the processor counted them (runtime/multimodal/
llava_onevision.py) and writes them over the item's placeholder rows of the token embeddings. Items wholly inside
a cached prefix are not encoded; an item cut by a prefix or chunk boundary (the scheduler avoids both) still gets
exactly its rows in range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from braid.runtime.loader.model_config import ModelConfig
from braid.runtime.models.llama import LlamaForCausalLM
from braid.runtime.models.siglip import SiglipVisionTower
from braid.runtime.multimodal.inputs import MultimodalItem
from braid.runtime.multimodal.llava_onevision import (anyres_feature_shape, max_tiles_of, select_best_resolution,
                                                       unpadded_grid)

# checkpoint prefixes (HF hub layout and transformers-5 layout) -> braid's module names
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
            ("model.vision_tower.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("model.image_newline", "image_newline"))


@dataclass
class _Placement:
    item: MultimodalItem
    lo: int  # first placeholder of the item in this pass (relative to the item)
    hi: int
    row: int  # its row in the pass's tokens


class MultimodalProjector(nn.Module):
    def __init__(self, in_features: int, hidden_size: int, act: str):
        super().__init__()
        self.linear_1 = ColumnParallelLinear(in_features, [hidden_size], bias=True)
        self.linear_2 = RowParallelLinear(hidden_size, hidden_size, bias=True)
        self.approximate = "tanh" if act == "gelu_tanh" else "none"
        if act not in ("gelu", "gelu_tanh"):
            raise ValueError(f"projector_hidden_act {act!r} is not supported (gelu, gelu_pytorch_tanh)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate=self.approximate))


class LlavaOnevisionForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        vision = config.vision
        if vision is None:
            raise ValueError("LlavaOnevisionForConditionalGeneration needs a vision_config")
        if vision.feature_select_strategy != "full":
            raise ValueError("LLaVA-OneVision needs vision_feature_select_strategy 'full' (SigLIP has no CLS token)")
        self.vision_tower = SiglipVisionTower(vision)
        num_selected = len(self.vision_tower.selected)
        self.multi_modal_projector = MultimodalProjector(vision.hidden_size * num_selected, config.hidden_size,
                                                         vision.projector_hidden_act)
        self.image_newline = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.tile = vision.image_size
        self.patches_per_side = vision.image_size // vision.patch_size
        self.pinpoints = vision.image_grid_pinpoints
        self.max_tiles = max_tiles_of(vision.vision_aspect_ratio)

    # ---- weights ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], device) -> None:
        super().load_weights(((n, t) for n, t in map(self._rename, weights) if n is not None), device)

    def _rename(self, item: tuple[str, torch.Tensor]) -> tuple[Optional[str], torch.Tensor]:
        name, tensor = item
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith("vision_tower.") and not self.vision_tower.wants_weight(name[len("vision_tower."):]):
            return None, tensor  # post_layernorm, the pooling head, layers past the selected one
        return name, tensor

    # ---- forward ----
    def forward(self, fb, input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        placements = self._placements(fb) if fb.forward_mode.is_extend() and fb.mm_inputs else []
        if not placements:
            return super().forward(fb, input_embeds)
        embeds = self.model.embed_tokens(fb.input_ids) if input_embeds is None else input_embeds
        features = self.encode([p.item for p in placements])
        for p, feat in zip(placements, features):
            embeds[p.row:p.row + p.hi - p.lo] = feat[p.lo:p.hi].to(embeds.dtype)
        return super().forward(fb, embeds)

    @staticmethod
    def _placements(fb) -> list[_Placement]:
        out, row0 = [], 0
        for mm, prefix, n in zip(fb.mm_inputs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            for item in (mm.items if mm is not None else ()):
                lo, hi = max(item.offset, prefix), min(item.end, prefix + n)
                if lo < hi:
                    out.append(_Placement(item, lo - item.offset, hi - item.offset, row0 + lo - prefix))
            row0 += n
        return out

    def encode(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """Each item's features in placeholder order: [item.num_tokens, hidden]. One tower call for all tiles."""
        device, dtype = self.image_newline.device, self.image_newline.dtype
        pixels = torch.cat([it.pixel_values for it in items]).to(device=device, dtype=dtype, non_blocking=True)
        tiles = self.vision_tower(pixels)  # [N, G*G, Dv]
        n, length, dv = tiles.shape
        tiles = self.multi_modal_projector(tiles.reshape(n * length, dv)).view(n, length, -1)  # [N, G*G, H]
        out, start = [], 0
        for it in items:
            count = it.pixel_values.shape[0]
            feats = tiles[start:start + count]
            start += count
            if it.modality == "video":
                packed = self._pack_video(feats)
            elif it.anyres:
                packed = self._pack_anyres(feats, it.image_size)
            else:
                packed = torch.cat([feats[0], self.image_newline[None]])
            if packed.shape[0] != it.num_tokens:
                raise ValueError(f"{it.modality} features ({packed.shape[0]}) differ from its placeholders "
                                 f"({it.num_tokens})")
            out.append(packed)
        return out

    def _pack_anyres(self, feats: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        # feats: [1 + rows_t * cols_t, G*G, H]; the base tile, then the grid's tiles row by row
        g, hidden = self.patches_per_side, feats.shape[-1]
        height, width = image_size
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        rows_t, cols_t = best_h // self.tile, best_w // self.tile
        if feats.shape[0] != 1 + rows_t * cols_t:
            raise ValueError(f"image of {height}x{width} has {feats.shape[0] - 1} grid tiles, expected "
                             f"{rows_t * cols_t}")
        # [rows_t, cols_t, G, G, H] -> [H, rows_t * G, cols_t * G]: the grid's features as one feature map
        grid = feats[1:].view(rows_t, cols_t, g, g, hidden).permute(4, 0, 2, 1, 3)
        grid = grid.reshape(hidden, rows_t * g, cols_t * g)
        top, bottom, left, right = unpadded_grid(height, width, rows_t * g, cols_t * g)
        grid = grid[:, top:bottom, left:right]
        rows, cols, shrink = anyres_feature_shape(height, width, rows_t * g, cols_t * g, self.max_tiles, g)
        if shrink:
            grid = F.interpolate(grid[None], [rows, cols], mode="bilinear")[0]
        newline = self.image_newline[:, None, None].expand(hidden, rows, 1).to(grid.dtype)
        grid = torch.cat([grid, newline], dim=-1).flatten(1, 2).transpose(0, 1)  # [rows * (cols + 1), H]
        return torch.cat([feats[0], grid])

    def _pack_video(self, feats: torch.Tensor) -> torch.Tensor:
        # feats: [frames, G*G, H] -> pooled 2x2 per frame, then one newline: [frames * ceil(G/2)^2 + 1, H]
        g, hidden = self.patches_per_side, feats.shape[-1]
        pooled_side = math.ceil(g / 2)
        frames = feats.view(-1, g, g, hidden).permute(0, 3, 1, 2)
        pooled = F.interpolate(frames, size=[pooled_side, pooled_side], mode="bilinear")
        return torch.cat([pooled.permute(0, 2, 3, 1).reshape(-1, hidden), self.image_newline[None]])
