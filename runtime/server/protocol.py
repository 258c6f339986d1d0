"""Request schemas of the native and OpenAI APIs: their shape, and the sampling-field dicts they carry.

Sampling fields are never listed here: whatever body key is a SamplingParams field name is handed to
`prepare_request` (runtime/server/prepare.py), which builds and checks the SamplingParams; only the
OpenAI and vLLM names that differ (max_tokens, min_tokens, response_format, best_of, guided_*,
include_stop_str_in_output) are translated. A top-level OpenAI parameter that is none of these is a 400
(`_check_parameter_names`); docs/api.md lists what is accepted and what is refused.
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict] = None


class ChatMessage(_Base):
    role: str
    content: Union[str, list[dict], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers


class _OpenAIRequest(_Base):
    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    min_tokens: Optional[int] = None
    rid: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    best_of: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    add_special_tokens: Optional[bool] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM: usage in every chunk, when include_usage asks for usage at all."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def extras(self) -> dict:
        return dict(self.model_extra or {})


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last (assistant) message, which the reply continues
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra variables for the chat template

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


# Top-level parameters accepted and deliberately without effect (docs/api.md lists them).
ACCEPTED_NO_OPS = frozenset({"user"})
# vLLM's guided-decoding backends: braid has one constrained-decoding engine (regex FSM over the tokenizer, the
# method of outlines), and every name selects it.
GUIDED_DECODING_BACKENDS = ("braid", "outlines", "lm-format-enforcer", "xgrammar")
# Parameters other servers take that braid does not implement -> the value that means "off" (accepted, since it
# asks for nothing), or _NEVER when any value is refused.
_NEVER = object()
NOT_SUPPORTED = {
    "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
    "guided_grammar": _NEVER, "suffix": None, "functions": _NEVER, "function_call": _NEVER, "echo": False,
    "chat_template": _NEVER, "documents": _NEVER,
    "mm_processor_kwargs": _NEVER, "truncate_prompt_tokens": None, "priority": 0, "request_id": _NEVER,
    "return_tokens_as_token_ids": False, "logits_processors": _NEVER, "store": False, "metadata": _NEVER,
    "modalities": _NEVER, "audio": _NEVER, "prediction": _NEVER, "reasoning_effort": _NEVER,
    "service_tier": _NEVER, "web_search_options": _NEVER,
}
_WHY_NOT = {"guided_grammar": "; grammars other than regex and JSON schema have no compiler in braid (use "
                              "guided_regex or guided_json)",
            "use_beam_search": "; braid samples (use n with best_of to rank samples by cumulative logprob)",
            "functions": "; use tools", "function_call": "; use tool_choice"}
_VLLM_EXTRAS = frozenset({"guided_json", "guided_regex", "guided_choice", "guided_whitespace_pattern",
                          "guided_decoding_backend", "include_stop_str_in_output"})


def parse_openai(model_cls: type[_OpenAIRequest], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    _check_parameter_names(model_cls, body)
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_tag(p)) or None
        raise bad_request(f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param) from None
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    return req


def _check_parameter_names(model_cls: type[_OpenAIRequest], body: dict) -> None:
    """400 naming the first parameter braid would not act on: unknown, or known and not supported."""
    known = set(model_cls.model_fields) | SAMPLING_FIELDS | _VLLM_EXTRAS | ACCEPTED_NO_OPS
    for name, value in body.items():
        if name in known:
            continue
        if name in NOT_SUPPORTED:
            off = NOT_SUPPORTED[name]
            if off is not _NEVER and (value is None or value == off):
                continue
            raise bad_request(f"{name} is not supported{_WHY_NOT.get(name, '')}", param=name, code="unsupported_parameter")
        raise bad_request(f"unknown parameter {name!r}", param=name, code="unknown_parameter")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(loc_part) -> bool:
    """pydantic puts the tried Union member in error locations ('str', 'list[int]'); they are no parameter."""
    return isinstance(loc_part, str) and (loc_part in _TYPE_TAGS or "[" in loc_part)


def _check_int(value: Any, param: str, lo: int, hi: Optional[int] = None) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad_request(f"{param}: must be an integer in {rng}, got {value!r}", param=param)


def openai_sampling_overrides(req: _OpenAIRequest) -> dict:
    """Body keys that are SamplingParams fields, plus the OpenAI and vLLM names translated (`constraint_param`
    says which parameter a regex/json_schema came from)."""
    extras = req.extras()
    d = {k: v for k, v in extras.items() if k in SAMPLING_FIELDS}
    max_tokens = getattr(req, "max_completion_tokens", None)
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = req.max_tokens, "max_tokens"
    _check_int(max_tokens, param, 0, 2**31 - 1)
    if max_tokens is not None:
        d["max_new_tokens"] = max_tokens
    if req.min_tokens is not None:
        d["min_new_tokens"] = req.min_tokens
    include_stop = extras.get("include_stop_str_in_output")
    if include_stop is not None:
        if not isinstance(include_stop, bool):
            raise bad_request("include_stop_str_in_output must be a boolean", param="include_stop_str_in_output")
        d["no_stop_trim"] = include_stop or bool(d.get("no_stop_trim"))
    if req.best_of is not None:
        _check_int(d.get("n"), "n", 1, 128)
        n = requested_n(req)
        _check_int(req.best_of, "best_of", n, 128)
        if req.best_of > n and req.stream:
            raise bad_request("best_of > n cannot be streamed (the best samples are known only at the end)",
                              param="best_of")
        d["n"] = req.best_of
    _check_int(req.prompt_logprobs, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    _constraint(req, d)
    return d


def requested_n(req: _OpenAIRequest) -> int:
    """How many choices the client gets (n); the request samples best_of of them when that is larger."""
    n = req.extras().get("n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


def _constraint(req: _OpenAIRequest, d: dict) -> None:
    """At most one of regex, json_schema, guided_json/_regex/_choice, response_format (non-text) -> d's regex or
    json_schema. guided_whitespace_pattern turns a JSON schema into a regex here, with that whitespace."""
    extras = req.extras()
    given = [k for k in ("regex", "json_schema", "guided_json", "guided_regex", "guided_choice") if
             extras.get(k) is not None]
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        given.append("response_format")
    if len(given) > 1:
        raise bad_request(f"{given[0]} and {given[1]} cannot be combined (one output constraint per request)",
                          param=given[0])
    backend = extras.get("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_DECODING_BACKENDS:
        raise bad_request(f"guided_decoding_backend must be one of {', '.join(GUIDED_DECODING_BACKENDS)} (all use "
                          f"braid's regex FSM), got {backend!r}", param="guided_decoding_backend")
    source = given[0] if given else None
    if source == "guided_json":
        d["json_schema"] = _json_schema_value(extras["guided_json"], "guided_json")
    elif source == "guided_regex":
        regex = extras["guided_regex"]
        if not isinstance(regex, str) or not regex:
            raise bad_request("guided_regex must be a non-empty string", param="guided_regex")
        d["regex"] = regex
    elif source == "guided_choice":
        d["regex"] = _choice_regex(extras["guided_choice"])
    elif source == "response_format":
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
    whitespace = extras.get("guided_whitespace_pattern")
    if whitespace is not None:
        if not isinstance(whitespace, str):
            raise bad_request("guided_whitespace_pattern must be a string", param="guided_whitespace_pattern")
        if d.get("json_schema") is None:
            raise bad_request("guided_whitespace_pattern applies to a JSON schema (guided_json, json_schema or "
                              "response_format)", param="guided_whitespace_pattern")
        d["regex"] = _schema_regex(d.pop("json_schema"), whitespace, source or "json_schema")


def constraint_param(req: _OpenAIRequest) -> Optional[str]:
    """The parameter a request's output constraint came from (for errors found later, e.g. by the compiler)."""
    extras = req.extras()
    for k in ("guided_json", "guided_regex", "guided_choice"):
        if extras.get(k) is not None:
            return k
    rf = getattr(req, "response_format", None)
    return "response_format" if rf is not None and rf.type != "text" else None


def _json_schema_value(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param}: not valid JSON ({e})", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object), got {type(value).__name__}", param=param)
    return json.dumps(value)


def _choice_regex(choices: Any) -> str:
    from braid.runtime.constrained.fsm import GrammarError
    from braid.runtime.constrained.json_schema import choices_to_regex

    if not isinstance(choices, list):
        raise bad_request("guided_choice must be a list of strings", param="guided_choice")
    try:
        return choices_to_regex(choices)
    except GrammarError as e:
        raise bad_request(f"guided_choice: {e}", param="guided_choice") from None


def _schema_regex(schema: Any, whitespace: str, param: str) -> str:
    from braid.runtime.constrained.fsm import GrammarError
    from braid.runtime.constrained.json_schema import json_schema_to_regex

    try:
        return json_schema_to_regex(schema, whitespace)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param=param) from None


@dataclass
class LogprobPlan:
    """What a request's logprobs serve: the client's output logprobs, prompt_logprobs, best_of's ranking."""

    output: bool  # the client asked for the output tokens' logprobs
    top_n: int  # alternatives per output token
    prompt: Optional[int] = None  # prompt_logprobs: alternatives per prompt token
    rank: bool = False  # best_of > n: choices are ranked by cumulative logprob
    echo: bool = False  # completions' echo: the prompt's logprobs come first

    def prepare_options(self) -> dict:
        """prepare_request's logprob keywords."""
        return {"return_logprob": self.output or self.prompt is not None or self.rank,
                "top_logprobs_num": max(self.top_n, self.prompt or 0),
                "logprob_start_len": 0 if self.prompt is not None or (self.echo and self.output) else -1}


_TEMPLATE_ARGUMENTS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                       "tokenize", "return_dict", "chat_template", "tokenizer_kwargs"}


def chat_template_options(req: ChatCompletionRequest) -> dict:
    """TokenizerManager.apply_chat_template's keywords for this request."""
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt to be false",
                              param="continue_final_message")
        if req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", param="continue_final_message")
    taken = sorted(set(req.chat_template_kwargs or {}) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise bad_request(f"chat_template_kwargs cannot set {taken[0]!r} (it has its own parameter)",
                          param="chat_template_kwargs")
    return {"add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message,
            "template_kwargs": req.chat_template_kwargs}


def chat_logprob_options(req: ChatCompletionRequest) -> tuple[bool, int]:
    _check_int(req.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    return bool(req.logprobs), int(req.top_logprobs or 0)


def completion_logprob_options(req: CompletionRequest) -> tuple[bool, int]:
    _check_int(req.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
    return req.logprobs is not None, int(req.logprobs or 0)


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
    video_data: list[Any] = field(default_factory=list)  # one entry per prompt: a video (frames) or a list of them


_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "rid", "image_data", "return_text_in_logprobs", "modalities", "video_data"}


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

    modalities = body.get("modalities")
    if modalities is not None and not (isinstance(modalities, list) and all(m in _MODALITIES for m in modalities)):
        raise bad_request(f"modalities must be a list of {', '.join(_MODALITIES)}", param="modalities")
    if "video" in (modalities or ()) and body.get("video_data") is not None:
        raise bad_request("give a video either as video_data or as image_data with modalities ['video'], not both",
                          param="video_data")
    images = _per_prompt(body.get("image_data"), is_batch, len(prompts))
    videos = _per_prompt(body.get("video_data"), is_batch, len(prompts))

    for name in ("stream", "return_logprob"):
        if not isinstance(body.get(name, False), bool):
            raise bad_request(f"{name} must be a boolean", param=name)
    return GenerateRequest(prompts=prompts, is_batch=is_batch, sampling_params=sps, stream=body.get("stream", False),
                           return_logprob=body.get("return_logprob", False),
                           logprob_start_len=body.get("logprob_start_len", -1),
                           top_logprobs_num=body.get("top_logprobs_num", 0), rids=rids, image_data=images,
                           is_video="video" in (modalities or ()), video_data=videos)


def _per_prompt(data: Any, is_batch: bool, count: int) -> list:
    """image_data / video_data: one entry per prompt of a batch when it is a list of that length, else shared."""
    if data is None:
        return [None] * count
    if is_batch and isinstance(data, list) and len(data) == count:
        return list(data)
    return [data] * count


# ---- SSE ----------------------------------------------------------------------------------------

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
