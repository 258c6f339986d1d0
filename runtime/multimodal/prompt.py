"""A prompt with images and videos -> input ids with content-derived pad runs, and the request's MultimodalInputs.

A text prompt marks each item with `<image>` or `<video>` (what the chat templates insert); a token-id prompt
with the model's image/video token id, once per item. Items fill the marks in order: the i-th `<image>` is the
i-th entry of image_data, the i-th `<video>` the i-th entry of video_data; the counts must match. The modality of
each item is explicit (which list it came in), never inferred from a count. As in HF's LLaVA-OneVision processor,
a request's only image is tiled (anyres); with several images each is one base tile. An image given as
{"url": ..., "detail": "low"} (OpenAI's image_url object) is one base tile even alone; "auto" and "high" tile it.
A video is a list of frames, {"frames": [...]}, or a video file ({"url": ..., "num_frames": n}, see media.py).
"""

from __future__ import annotations

import re
from typing import Any, Union

from braid.runtime.core import RequestError
from braid.runtime.multimodal.inputs import MultimodalInputs, pad_ids
from braid.runtime.multimodal.media import MediaError, MediaLimits, load_image, load_video

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_MARKS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def _detail(image: Any) -> str:
    detail = image.get("detail") or "auto" if isinstance(image, dict) else "auto"
    if detail not in ("auto", "low", "high"):
        raise MediaError(f"image detail must be 'auto', 'low' or 'high', got {detail!r}", "image_data")
    return detail


def as_item_list(data: Any) -> list:
    """image_data / video_data as a list of items (one item may be given bare)."""
    if data is None or data == "" or data == []:
        return []
    return list(data) if isinstance(data, (list, tuple)) else [data]


def as_video_list(data: Any) -> list:
    """video_data as a list of videos. A video is a list of frames, {"frames": [...]}, {"url": <video file>} or a
    video file's data URL/path/bytes given bare; a list of strings or bytes is one video's frames."""
    if not isinstance(data, (list, tuple)):
        return as_item_list(data)
    items = as_item_list(data)
    if items and not any(isinstance(v, (list, tuple, dict)) for v in items):
        return [items]
    return items


class MultimodalPreparer:
    """Everything request preparation needs for a vision model: its processor, placeholder token ids, limits."""

    def __init__(self, processor, image_token_id: int, video_token_id: int, limits: MediaLimits):
        if image_token_id is None or video_token_id is None:
            raise ValueError("a vision model's config needs image_token_index and video_token_index")
        self.processor = processor
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.limits = limits

    @classmethod
    def for_model(cls, model_config, limits: MediaLimits) -> "MultimodalPreparer":
        from braid.runtime.multimodal.llava_onevision import LlavaOnevisionProcessor

        vision = model_config.vision
        return cls(LlavaOnevisionProcessor(vision, model_config.path), vision.image_token_id, vision.video_token_id,
                   limits)

    @classmethod
    def for_server(cls, server_args) -> "MultimodalPreparer":
        from braid.runtime.loader import load_model_config

        return cls.for_model(load_model_config(server_args), MediaLimits.from_server_args(server_args))

    def prepare(self, tokenizer, prompt: Union[str, list[int]], image_data: Any, video_data: Any,
                add_special_tokens: bool) -> tuple[list[int], MultimodalInputs]:
        images, videos = as_item_list(image_data), as_video_list(video_data)
        if len(images) + len(videos) > self.limits.max_items:
            raise MediaError(f"a request may hold at most {self.limits.max_items} images and videos, got "
                             f"{len(images) + len(videos)}", "image_data" if images else "video_data")
        segments = self._segments(tokenizer, prompt, add_special_tokens)
        marks = [s for s in segments if isinstance(s, str)]
        for kind, mark, given, param in (("image", IMAGE_PLACEHOLDER, images, "image_data"),
                                         ("video", VIDEO_PLACEHOLDER, videos, "video_data")):
            if marks.count(kind) != len(given):
                raise RequestError(f"the prompt marks {marks.count(kind)} {kind}(s) ({mark} in text, or the {kind} "
                                   f"token id in input ids) but {param} holds {len(given)}", param)
        # a request's only image is tiled, unless it asks for detail "low" (OpenAI's one low-resolution tile)
        details = [_detail(image) for image in images]
        anyres = len(images) == 1 and details[0] != "low"
        loaded_images = iter([load_image(s, self.limits, "image_data") for s in images])
        loaded_videos = iter([load_video(s, self.limits, "video_data") for s in videos])
        input_ids: list[int] = []
        mm = MultimodalInputs()
        for segment in segments:
            if isinstance(segment, list):
                input_ids.extend(segment)
                continue
            if segment == "image":
                item = self.processor.image_item(next(loaded_images), anyres)
            else:
                item = self.processor.video_item(next(loaded_videos))
            item.offset = len(input_ids)
            item.token_id = self.image_token_id if segment == "image" else self.video_token_id
            input_ids.extend(pad_ids(item.content_hash, item.num_tokens))
            mm.items.append(item)
        return input_ids, mm

    def _segments(self, tokenizer, prompt: Union[str, list[int]], add_special_tokens: bool) -> list:
        """The prompt as token-id lists and "image"/"video" marks, in order."""
        out: list = []
        if isinstance(prompt, str):
            # the tokenizer's own prefix (a BOS, or nothing) once at the start, then each text piece bare
            special = list(tokenizer.encode("", add_special_tokens=True)) if add_special_tokens else []
            if special:
                out.append(special)
            for part in _MARKS.split(prompt):
                if part == IMAGE_PLACEHOLDER or part == VIDEO_PLACEHOLDER:
                    out.append("image" if part == IMAGE_PLACEHOLDER else "video")
                elif part:
                    out.append(list(tokenizer.encode(part, add_special_tokens=False)))
            return out
        run: list[int] = []
        for t in prompt:
            if t in (self.image_token_id, self.video_token_id):
                out.extend([run, "image" if t == self.image_token_id else "video"])
                run = []
            else:
                run.append(t)
        out.append(run)
        return [s for s in out if s != []]
