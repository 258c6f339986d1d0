"""What a request carries for its images and videos, and the pad ids that key the radix cache on pixel content.

Every item's placeholder is a run of `num_tokens` ids inside `Req.input_ids`, drawn from the sha256 of the item's
pixels (decoded RGB bytes, their shapes and how the item is tiled): one pseudo-random id per position in
[2^32, 2^62), outside every vocabulary. The same image gives the same run, so its KV is shared through the radix
cache; two different images differ at their first id (a 2^-62 chance otherwise), whatever URL string they came
from. The model never sees these ids: the extend batch carries `model_ids` (the item's image or video token id
at each placeholder) and the model writes the item's features over those rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

MODALITIES = ("image", "video")


@dataclass
class MultimodalItem:
    modality: str  # "image" | "video"
    pixel_values: torch.Tensor  # image: [tiles, C, S, S] (base tile first); video: [frames, C, S, S]; fp32, host
    image_size: tuple[int, int]  # (height, width) of the image as loaded (video: of its first frame)
    anyres: bool  # image: tiled on the best grid (the request's only image) or the base tile alone
    content_hash: str  # sha256 hex of the pixels and the tiling
    num_tokens: int  # placeholder tokens the model fills
    token_id: int = 0  # the model's image/video token id: what the model's input ids hold at the placeholders
    offset: int = 0  # first placeholder position in input_ids (set when the prompt is assembled)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass
class MultimodalInputs:
    """The request's media in prompt order."""

    items: list[MultimodalItem] = field(default_factory=list)

    def item_starts_and_ends(self) -> list[tuple[int, int]]:
        return [(it.offset, it.end) for it in self.items]

    def model_ids(self, ids: list[int], start: int) -> list[int]:
        """`ids` (positions start.. of the request's tokens) with each placeholder as its item's token id."""
        out = list(ids)
        stop = start + len(ids)
        for it in self.items:
            lo, hi = max(it.offset, start), min(it.end, stop)
            if lo < hi:
                out[lo - start:hi - start] = [it.token_id] * (hi - lo)
        return out


def content_hash(modality: str, arrays: list[np.ndarray], tiling: str) -> str:
    h = hashlib.sha256()
    h.update(f"{modality}|{tiling}|{len(arrays)}".encode())
    for a in arrays:
        h.update(repr(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


PAD_ID_LOW, PAD_ID_HIGH = 1 << 32, 1 << 62


def pad_ids(content_hash_hex: str, num_tokens: int) -> list[int]:
    """`num_tokens` ids in [2^32, 2^62), a deterministic function of the content hash (same in every process)."""
    seed = int(content_hash_hex[:32], 16)
    return np.random.Generator(np.random.PCG64(seed)).integers(PAD_ID_LOW, PAD_ID_HIGH, num_tokens).tolist()


def item_aligned_prefix_len(mm: Optional[MultimodalInputs], prefix_len: int) -> int:
    """The longest prefix no longer than `prefix_len` that does not end inside an item (a cached prefix is cut
    where the scheduler must recompute, e.g. the last prompt token; the item is then encoded whole)."""
    if mm is None:
        return prefix_len
    for start, end in mm.item_starts_and_ends():
        if start < prefix_len < end:
            return start
    return prefix_len


def item_aligned_chunk_len(mm: Optional[MultimodalInputs], start: int, length: int) -> int:
    """A chunk [start, start + length) shortened so that it does not end inside an item; an item longer than the
    whole chunk budget is taken whole when it is the chunk's first item (0 is never returned for length > 0)."""
    if mm is None or length <= 0:
        return length
    stop = start + length
    for item_start, item_end in mm.item_starts_and_ends():
        if item_start < stop < item_end:
            return item_start - start if item_start > start else item_end - start
    return length


def inputs_from_wire(media: list) -> MultimodalInputs:
    """MultimodalInputs from the `messages.MediaItem`s of a GenerateReq."""
    items = []
    for m in media:
        if m.modality not in MODALITIES:
            raise ValueError(f"unknown media modality {m.modality!r}")
        pixels = torch.frombuffer(bytearray(m.pixels), dtype=torch.float32).view(m.shape)
        items.append(MultimodalItem(modality=m.modality, pixel_values=pixels, image_size=tuple(m.image_size),
                                    anyres=m.anyres, content_hash=m.content_hash, num_tokens=m.num_tokens,
                                    token_id=m.token_id, offset=m.offset))
    return MultimodalInputs(items)
