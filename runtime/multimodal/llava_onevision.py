"""LLaVA-OneVision pixel processing and placeholder counts (PIL + numpy; HF's processor is only the test reference).

Tiles are S x S (S = the vision tower's image_size) with G = S / patch_size patches a side; the tower gives G*G
features per tile (SigLIP has no CLS token).
- One image in a request ("anyres"): a base tile (the image resized to S x S) plus the image resized to fit the
  best grid resolution among `image_grid_pinpoints`, zero-padded to it and cut into S x S tiles. The model unpads
  the grid's features back to the image's aspect ratio, shrinks them when they exceed `anyres_max_N` tiles' worth,
  and ends each feature row with `image_newline`: G*G + rows*(cols+1) tokens.
- Several images in a request: each image padded to a square with the mean colour, one tile: G*G + 1 tokens.
- A video: every frame resized to S x S; the model pools each frame's G x G features 2x2 (bilinear, to ceil(G/2)
  a side) and ends the video with one `image_newline`: frames * ceil(G/2)^2 + 1 tokens.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from braid.runtime.multimodal.inputs import MultimodalItem, content_hash

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) among `pinpoints` that keeps the most of the image's pixels, then wastes the fewest."""
    best, best_effective, best_wasted = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    return best


def unpadded_grid(height: int, width: int, grid_rows: int, grid_cols: int) -> tuple[int, int, int, int]:
    """Feature rows/cols kept after unpadding a [grid_rows, grid_cols] feature map of an image of (height, width)
    fitted into it: (top, bottom, left, right) bounds."""
    if width / height > grid_cols / grid_rows:
        new_rows = int(round(height * (grid_cols / width), 7))
        pad = (grid_rows - new_rows) // 2
        return pad, grid_rows - pad, 0, grid_cols
    new_cols = int(round(width * (grid_rows / height), 7))
    pad = (grid_cols - new_cols) // 2
    return 0, grid_rows, pad, grid_cols - pad


def anyres_feature_shape(height: int, width: int, grid_rows: int, grid_cols: int, max_tiles: int,
                         patches_per_side: int) -> tuple[int, int, bool]:
    """(rows, cols, downscaled) of the unpadded grid features after the anyres_max_N shrink."""
    top, bottom, left, right = unpadded_grid(height, width, grid_rows, grid_cols)
    rows, cols = bottom - top, right - left
    ratio = math.sqrt(rows * cols / (max_tiles * patches_per_side ** 2))
    if ratio > 1.1:
        return int(rows // ratio), int(cols // ratio), True
    return rows, cols, False


def max_tiles_of(vision_aspect_ratio: Optional[str]) -> int:
    ratio = vision_aspect_ratio or "anyres_max_9"
    if not ratio.startswith("anyres_max_") or not ratio.removeprefix("anyres_max_").isdigit():
        raise ValueError(f"vision_aspect_ratio {ratio!r} is not supported; expected anyres_max_<N>")
    return int(ratio.removeprefix("anyres_max_"))


@dataclass(frozen=True)
class ProcessorConfig:
    tile: int  # S
    patch: int
    pinpoints: tuple[tuple[int, int], ...]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    max_tiles: int

    @property
    def patches_per_side(self) -> int:
        return self.tile // self.patch


class LlavaOnevisionProcessor:
    """Images and frames -> MultimodalItems (pixels, placeholder counts, content hashes)."""

    def __init__(self, vision, model_path: Optional[str] = None):
        pre = {}
        if model_path and os.path.exists(os.path.join(model_path, "preprocessor_config.json")):
            with open(os.path.join(model_path, "preprocessor_config.json")) as f:
                pre = json.load(f)
        size = pre.get("size") or {}
        tile = int(size.get("height") or size.get("shortest_edge") or vision.image_size)
        if tile != vision.image_size:
            raise ValueError(f"preprocessor size {tile} differs from the vision tower's image_size {vision.image_size}")
        if vision.feature_select_strategy != "full":
            raise ValueError("LLaVA-OneVision needs vision_feature_select_strategy 'full' (SigLIP has no CLS token)")
        pinpoints = tuple(tuple(p) for p in (pre.get("image_grid_pinpoints") or vision.image_grid_pinpoints))
        if not pinpoints:
            raise ValueError("the config has no image_grid_pinpoints")
        self.config = ProcessorConfig(tile=tile, patch=vision.patch_size, pinpoints=pinpoints,
                                      mean=tuple(pre.get("image_mean") or CLIP_MEAN),
                                      std=tuple(pre.get("image_std") or CLIP_STD),
                                      max_tiles=max_tiles_of(vision.vision_aspect_ratio))

    # ---- token counts ----
    def image_tokens(self, height: int, width: int, anyres: bool) -> int:
        c = self.config
        g = c.patches_per_side
        if not anyres:
            return g * g + 1
        best_h, best_w = select_best_resolution(height, width, c.pinpoints)
        rows, cols, _ = anyres_feature_shape(height, width, best_h // c.tile * g, best_w // c.tile * g,
                                             c.max_tiles, g)
        return g * g + rows * (cols + 1)

    def video_tokens(self, num_frames: int) -> int:
        pooled = math.ceil(self.config.patches_per_side / 2)
        return num_frames * pooled * pooled + 1

    # ---- pixels ----
    def image_item(self, image, anyres: bool) -> MultimodalItem:
        """`image`: a PIL image (converted to RGB here)."""
        rgb = np.asarray(image.convert("RGB"))  # [H, W, 3] uint8
        height, width = rgb.shape[:2]
        c = self.config
        if anyres:
            tiles = [self._resize(rgb, c.tile, c.tile)] + self._grid_tiles(rgb)
        else:
            tiles = [self._resize(self._pad_to_square(rgb), c.tile, c.tile)]
        return MultimodalItem(modality="image", pixel_values=self._normalize(tiles), image_size=(height, width),
                              anyres=anyres, content_hash=content_hash("image", [rgb], "anyres" if anyres else "base"),
                              num_tokens=self.image_tokens(height, width, anyres))

    def video_item(self, frames: list) -> MultimodalItem:
        if not frames:
            raise ValueError("a video needs at least one frame")
        rgbs = [np.asarray(f.convert("RGB")) for f in frames]
        c = self.config
        tiles = [self._resize(rgb, c.tile, c.tile) for rgb in rgbs]
        return MultimodalItem(modality="video", pixel_values=self._normalize(tiles), image_size=rgbs[0].shape[:2],
                              anyres=False, content_hash=content_hash("video", rgbs, "frames"),
                              num_tokens=self.video_tokens(len(rgbs)))

    def _grid_tiles(self, rgb: np.ndarray) -> list[np.ndarray]:
        c = self.config
        height, width = rgb.shape[:2]
        best_h, best_w = select_best_resolution(height, width, c.pinpoints)
        # fit inside the grid keeping the aspect ratio, then pad with black, centred
        if best_w / width < best_h / height:
            new_w, new_h = best_w, min(math.ceil(height * best_w / width), best_h)
        else:
            new_h, new_w = best_h, min(math.ceil(width * best_h / height), best_w)
        fitted = self._resize(rgb, new_h, new_w)
        top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
        canvas = np.zeros((best_h, best_w, 3), dtype=np.uint8)
        canvas[top:top + new_h, left:left + new_w] = fitted
        return [canvas[i:i + c.tile, j:j + c.tile] for i in range(0, best_h, c.tile) for j in range(0, best_w, c.tile)]

    def _pad_to_square(self, rgb: np.ndarray) -> np.ndarray:
        height, width = rgb.shape[:2]
        if height == width:
            return rgb
        side = max(height, width)
        canvas = np.empty((side, side, 3), dtype=np.uint8)
        canvas[:] = np.array([int(m * 255) for m in self.config.mean], dtype=np.uint8)
        top, left = (side - height) // 2, (side - width) // 2
        canvas[top:top + height, left:left + width] = rgb
        return canvas

    @staticmethod
    def _resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
        from PIL import Image

        if rgb.shape[:2] == (height, width):
            return rgb
        return np.asarray(Image.fromarray(rgb).resize((width, height), resample=_BICUBIC))

    def _normalize(self, tiles: list[np.ndarray]) -> torch.Tensor:
        # [N, S, S, 3] uint8 -> [N, 3, S, S] fp32 through a per-channel table of the 256 values
        stacked = np.stack(tiles)
        out = np.empty((stacked.shape[0], 3) + stacked.shape[1:3], dtype=np.float32)
        for c in range(3):
            np.take(self._lut[c], stacked[..., c], out=out[:, c])
        return torch.from_numpy(out)

    @functools.cached_property
    def _lut(self) -> np.ndarray:
        # [3, 256]: rescaled in float64 and rounded to fp32, then (x - mean) / std in fp32 (HF's arithmetic)
        scaled = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
        mean = np.array(self.config.mean, dtype=np.float32)[:, None]
        std = np.array(self.config.std, dtype=np.float32)[:, None]
        return (scaled[None] - mean) / std
