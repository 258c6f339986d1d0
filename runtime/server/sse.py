"""Server-sent events and JSON bytes for the streaming routes."""

from __future__ import annotations

from typing import Any

import msgspec

from braid.runtime.server.errors import APIError


SSE_DONE = b"data: [DONE]\n\n"


_json = msgspec.json.Encoder()


def json_bytes(obj: Any) -> bytes:
    """UTF-8 JSON of plain data (non-finite floats become null)."""
    return _json.encode(obj)


def sse_event(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class TextChunkTemplate:
    """The SSE chunks of one OpenAI stream that carry only text (no logprobs, no finish): their constant parts
    encoded once. `chunk(index, text)` is byte for byte `sse_event` of {"id", "object", "created", "model",
    "choices": [{"index", "delta": {"content": text}} (chat) or "text": text, "logprobs": None, "finish_reason": None]}
    (then "usage": None when `usage_null`)."""

    def __init__(self, rid: str, obj: str, created: int, model: str, chat: bool, usage_null: bool):
        head = _json.encode({"id": rid, "object": obj, "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'
        self._text_key = b',"delta":{"content":' if chat else b',"text":'
        self._tail = ((b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null}]'
                      + (b',"usage":null' if usage_null else b"") + b"}\n\n")

    def chunk(self, index: int, text: str) -> bytes:
        return b"%s%d%s%s%s" % (self._head, index, self._text_key, _json.encode(text), self._tail)


def api_error_event(err: APIError) -> bytes:
    return sse_event(err.to_dict())
