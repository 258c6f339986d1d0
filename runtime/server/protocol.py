"""Request schemas of the native and OpenAI APIs: their shape, and the sampling-field dicts they carry.

Sampling fields are never listed here: whatever body key is a SamplingParams field name is handed to
`prepare_request` (runtime/server/prepare.py), which builds and checks the SamplingParams; only the
OpenAI names that differ (max_tokens, min_tokens, response_format) are translated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from braid.runtime.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from braid.runtime.server.errors import APIError, bad_request

SAMPLING_FIELDS = frozenset(SamplingParams.field_names())

# ---- OpenAI schemas ---------------------------------------------------------------------------


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Base):
    include_usage: bool = False


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict] = None


class ChatMessage(_Base):
    role: str
    content: Union[str, list[dict], None] = None
    name: Optional[str] = None


class _OpenAIRequest(_Base):
    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    min_tokens: Optional[int] = None
    rid: Optional[str] = None
    response_format: Optional[ResponseFormat] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def extras(self) -> dict:
        return dict(self.model_extra or {})


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("must contain at least one message")
        return v


class CompletionRequest(_OpenAIRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


def parse_openai(model_cls: type[_OpenAIRequest], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_tag(p)) or None
        raise bad_request(f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(loc_part) -> bool:
    """pydantic puts the tried Union member in error locations ('str', 'list[int]'); they are no parameter."""
    return isinstance(loc_part, str) and (loc_part in _TYPE_TAGS or "[" in loc_part)


def _unsupported(req: _OpenAIRequest, names: tuple[str, ...]) -> None:
    extras = req.extras()
    for name in names:
        value = getattr(req, name, None) if name in type(req).model_fields else extras.get(name)
        if value not in (None, [], {}, False):
            raise bad_request(f"{name} is not supported", param=name)


def _check_int(value: Any, param: str, lo: int, hi: Optional[int] = None) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad_request(f"{param}: must be an integer in {rng}, got {value!r}", param=param)


def openai_sampling_overrides(req: _OpenAIRequest) -> dict:
    """Body keys that are SamplingParams fields, plus the OpenAI names translated."""
    d = {k: v for k, v in req.extras().items() if k in SAMPLING_FIELDS}
    max_tokens = getattr(req, "max_completion_tokens", None)
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = req.max_tokens, "max_tokens"
    _check_int(max_tokens, param, 0, 2**31 - 1)
    if max_tokens is not None:
        d["max_new_tokens"] = max_tokens
    if req.min_tokens is not None:
        d["min_new_tokens"] = req.min_tokens
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if d.get("regex") is not None or d.get("json_schema") is not None:
            raise bad_request("response_format cannot be combined with regex or json_schema", param="response_format")
        if rf.type == "json_object":
            d["json_schema"] = {"type": "object"}
        else:
            spec = rf.json_schema or {}
            schema = spec.get("schema")
            if schema is None:
                raise bad_request("response_format.json_schema.schema is required", param="response_format")
            if not isinstance(schema, (dict, bool)):
                raise bad_request("response_format.json_schema.schema must be an object", param="response_format")
            d["json_schema"] = json.dumps(schema)
    return d


def chat_logprob_options(req: ChatCompletionRequest) -> tuple[bool, int]:
    _check_int(req.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    return bool(req.logprobs), int(req.top_logprobs or 0)


def completion_logprob_options(req: CompletionRequest) -> tuple[bool, int]:
    _check_int(req.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
    return req.logprobs is not None, int(req.logprobs or 0)


def check_chat_supported(req: ChatCompletionRequest) -> None:
    _unsupported(req, ("tools", "tool_choice", "functions", "logit_bias"))


def check_completion_supported(req: CompletionRequest) -> None:
    _unsupported(req, ("suffix", "logit_bias"))
    n = req.extras().get("n", 1)
    if req.best_of is not None and req.best_of != n:
        raise bad_request("best_of different from n is not supported", param="best_of")


# ---- native /generate ---------------------------------------------------------------------------


@dataclass
class GenerateRequest:
    """A validated native /generate body; `prompts` holds texts or token-id lists, one per request."""

    prompts: list[Union[str, list[int]]]
    is_batch: bool
    sampling_params: list[Optional[dict]]  # SamplingParams fields, one dict (or None) per prompt
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    rids: Optional[list[str]] = None
    image_data: list[Any] = field(default_factory=list)  # one entry per prompt
    is_video: bool = False  # modalities says image_data holds video frames


_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "rid", "image_data", "return_text_in_logprobs", "modalities"}


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


_MODALITIES = ("image", "multi-images", "video")


def parse_generate(body: Any) -> GenerateRequest:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("exactly one of text or input_ids is required", param="text")
    if text is not None:
        if isinstance(text, str):
            prompts, is_batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = list(text), True
        else:
            raise bad_request("text must be a string or a non-empty list of strings", param="text")
    else:
        if _is_id_list(ids) and ids:
            prompts, is_batch = [ids], False
        elif isinstance(ids, list) and ids and all(_is_id_list(x) and x for x in ids):
            prompts, is_batch = list(ids), True
        else:
            raise bad_request("input_ids must be a non-empty list of integers or of such lists", param="input_ids")

    raw_sp = body.get("sampling_params")
    sps = raw_sp if isinstance(raw_sp, list) else [raw_sp] * len(prompts)
    if len(sps) != len(prompts):
        raise bad_request("sampling_params list must have one entry per prompt", param="sampling_params")
    if not all(sp is None or isinstance(sp, dict) for sp in sps):
        raise bad_request("sampling_params must be an object (or a list with one object per prompt)",
                          param="sampling_params")

    rid = body.get("rid")
    rids = None
    if rid is not None:
        rids = [rid] if isinstance(rid, str) else rid
        if not (isinstance(rids, list) and all(isinstance(r, str) and r for r in rids) and len(rids) == len(prompts)):
            raise bad_request("rid must be a string (or a list with one string per prompt)", param="rid")
        if len(set(rids)) != len(rids):
            raise bad_request("rid values must be distinct", param="rid")

    image_data = body.get("image_data")
    if image_data is None:
        images = [None] * len(prompts)
    elif is_batch and isinstance(image_data, list) and len(image_data) == len(prompts):
        images = list(image_data)
    else:
        images = [image_data] * len(prompts)
    modalities = body.get("modalities")
    if modalities is not None and not (isinstance(modalities, list) and all(m in _MODALITIES for m in modalities)):
        raise bad_request(f"modalities must be a list of {', '.join(_MODALITIES)}", param="modalities")

    for name in ("stream", "return_logprob"):
        if not isinstance(body.get(name, False), bool):
            raise bad_request(f"{name} must be a boolean", param=name)
    return GenerateRequest(prompts=prompts, is_batch=is_batch, sampling_params=sps, stream=body.get("stream", False),
                           return_logprob=body.get("return_logprob", False),
                           logprob_start_len=body.get("logprob_start_len", -1),
                           top_logprobs_num=body.get("top_logprobs_num", 0), rids=rids, image_data=images,
                           is_video="video" in (modalities or ()))


# ---- SSE ----------------------------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"


_json = msgspec.json.Encoder()


def json_bytes(obj: Any) -> bytes:
    """UTF-8 JSON of plain data (non-finite floats become null)."""
    return _json.encode(obj)


def sse_event(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def api_error_event(err: APIError) -> bytes:
    return sse_event(err.to_dict())
