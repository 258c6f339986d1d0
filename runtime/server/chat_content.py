"""OpenAI chat messages as a chat template takes them: content parts to template parts and the media they carry, the
placeholders a rendered prompt holds, and /apply_chat_template's messages checked (the formats themselves:
runtime/chat_format.py).
"""

from __future__ import annotations

from typing import Any

from braid.runtime.chat_format import Content
from braid.runtime.multimodal.prompt import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from braid.runtime.server.errors import bad_request

# content part type -> (its payload key, prepare_request's keyword, the part the template sees)
_MEDIA_PARTS = {"image_url": ("image_url", "image_data", "image"), "video_url": ("video_url", "video_data", "video"),
                "input_audio": ("input_audio", "audio_data", None)}


def template_messages(messages: list) -> tuple[list[dict], dict[str, list]]:
    """OpenAI chat messages (protocol.ChatMessage) -> ([{"role", "content", "name"?}], the media their parts carry as
    {"image_data" | "video_data" | "audio_data": [payload, ...]}). Content given as a string stays a string; content
    given as parts becomes template parts (`in_content_format` shapes both for the template)."""
    out: list[dict] = []
    media: dict[str, list] = {}
    for i, m in enumerate(messages):
        content = m.content
        if content is None or isinstance(content, str):
            parts: Content = content or ""
        else:
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in _MEDIA_PARTS and isinstance(part.get(_MEDIA_PARTS[kind][0]), dict):
                    key, param, template_kind = _MEDIA_PARTS[kind]
                    payload = part[key]
                    if template_kind is None:  # audio: no model here takes it; prepare_request refuses it
                        media.setdefault(param, []).append(payload.get("url", payload))
                    else:  # the whole {"url", "detail"} / {"frames"} object
                        media.setdefault(param, []).append(payload)
                        parts.append({"type": template_kind})
                else:  # parse_openai checked each part's shape
                    raise bad_request(f"messages[{i}].content: content part {kind!r} is malformed",
                                      param=f"messages.{i}.content")
        d = {"role": "system" if m.role == "developer" else m.role, "content": parts}
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out, media


def add_text(content: Content, text: str, before: bool = False) -> Content:
    """`text` after (or before) the content: a string grows, parts get a text part."""
    if isinstance(content, list):
        part = [{"type": "text", "text": text}]
        return part + content if before else content + part
    return text + content if before else content + text


def count_placeholders(prompt: str) -> dict[str, int]:
    """How many <image> / <video> placeholders a rendered prompt holds, by media keyword."""
    return {"image_data": prompt.count(IMAGE_PLACEHOLDER), "video_data": prompt.count(VIDEO_PLACEHOLDER)}


# ---- messages already in the template's shape (the native /apply_chat_template route) ----------------------------
_TEMPLATE_PART_TYPES = ("text", "image", "video")


def parse_template_messages(raw: Any) -> list[dict]:
    """[{"role", "content": str | [{"type": "text", "text"} | {"type": "image"} | {"type": "video"}]}] as HF's
    apply_chat_template takes them, checked; the content a template gets is shaped by `in_content_format`."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or set(m) - {"role", "content"}:
            raise bad_request(f"messages[{i}] must be an object with a string role and a content, nothing else",
                              param=f"messages.{i}")
        content = m.get("content")
        if isinstance(content, list):
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind not in _TEMPLATE_PART_TYPES or (kind == "text") != isinstance(p.get("text"), str) \
                        or set(p) - {"type", "text"}:
                    raise bad_request(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": str}}, "
                                      "{\"type\": \"image\"} or {\"type\": \"video\"}", param=f"messages.{i}.content")
            content = [dict(p) for p in content]
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of parts",
                              param=f"messages.{i}.content")
        out.append({"role": m["role"], "content": content or ""})
    return out
