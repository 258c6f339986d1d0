"""The OpenAI routes' request schemas (chat and text completions): their shape, the parameters accepted, refused
and translated into SamplingParams fields.

Sampling fields are never listed here: whatever body key is a SamplingParams field name is handed to
`prepare_request` (runtime/request_io/prepare.py), which builds and checks the SamplingParams; only the OpenAI and
vLLM names that differ (max_tokens, min_tokens, best_of, include_stop_str_in_output, and the output constraints of
openai_constraints.py) are translated. A top-level OpenAI parameter that is none of these is a 400
(`_check_parameter_names`); docs/api.md lists what is accepted and what is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from braid.runtime.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from braid.runtime.server.errors import asks_for_nothing, bad_request, json_type
from braid.runtime.server.openai_constraints import GrammarServing, check_response_format, constrain

SAMPLING_FIELDS = frozenset(SamplingParams.field_names())


SAMPLING_FIELDS = frozenset(SamplingParams.field_names())


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")  # top-level keys are checked by _check_parameter_names


class _Strict(BaseModel):
    """A nested object: a key it does not define is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[dict] = None  # {name, schema, strict, description}: checked by _check_response_format
    # type structural_tag: either structures with triggers (SGLang's and vLLM's first form) or format (the newer one)
    structures: Optional[list] = None
    triggers: Optional[list] = None
    format: Optional[dict] = None


class ChatMessage(_Base):
    """A key it does not define is a 400 naming it unless null (an SDK's model_dump() of a reply sends its unset
    fields, e.g. annotations, as null): _check_message."""

    role: str
    content: Union[str, list[dict], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers
    # OpenAI's, not rendered into the prompt: accepted only when they ask for nothing (see _check_message)
    function_call: Any = None
    refusal: Any = None
    audio: Any = None


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
    rid: Union[str, list[str], None] = None  # a list: one per prompt, as /generate
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False


# Top-level parameters accepted and deliberately without effect (docs/api.md lists them) -> the type they must have.
ACCEPTED_NO_OPS = {"user": str}


# Parameters other servers take that braid does not implement -> the values besides null that ask for nothing
# (accepted); any other value is a 400.
NOT_SUPPORTED = {
    "use_beam_search": (False,), "length_penalty": (1.0,), "early_stopping": (False,),
    "suffix": ("",), "functions": ([],), "function_call": ("none",), "echo": (False,),
    "chat_template": (), "documents": ([],),
    "mm_processor_kwargs": ({},), "truncate_prompt_tokens": (), "priority": (0,), "request_id": (),
    "return_tokens_as_token_ids": (False,), "logits_processors": ([],), "store": (False,), "metadata": ({},),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
    "service_tier": ("auto", "default"), "web_search_options": (),
}


_WHY_NOT = {"use_beam_search": "; braid samples (use n with best_of to rank samples by cumulative logprob)",
            "functions": "; use tools", "function_call": "; use tool_choice"}


_VLLM_EXTRAS = frozenset({"guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
                          "guided_decoding_backend", "structured_outputs", "include_stop_str_in_output"})


def parse_openai(model_cls: type[_OpenAIRequest], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    _check_parameter_names(model_cls, body)
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [p for p in err.get("loc", ()) if not _is_union_tag(p)]
        param = ".".join(str(p) for p in loc) or None
        if err.get("type") == "extra_forbidden":
            where = ".".join(str(p) for p in loc[:-1])
            raise bad_request(f"unknown key {loc[-1]!r} in {where}", param=param, code="unknown_parameter") from None
        raise bad_request(f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param) from None
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if req.rid == "":
        raise bad_request("rid must not be empty", param="rid")
    if req.response_format is not None:
        check_response_format(req.response_format)
    for i, message in enumerate(getattr(req, "messages", ())):
        _check_message(message, i)
    return req


def _check_parameter_names(model_cls: type[_OpenAIRequest], body: dict) -> None:
    """400 naming the first parameter braid would not act on: unknown, or known and not supported."""
    known = set(model_cls.model_fields) | SAMPLING_FIELDS | _VLLM_EXTRAS
    for name, value in body.items():
        if name in known:
            continue
        if name in ACCEPTED_NO_OPS:
            if value is not None and not isinstance(value, ACCEPTED_NO_OPS[name]):
                raise bad_request(f"{name} must be a string, got {json_type(value)}", param=name)
            continue
        if name in NOT_SUPPORTED:
            if asks_for_nothing(value, NOT_SUPPORTED[name]):
                continue
            raise bad_request(f"{name} is not supported{_WHY_NOT.get(name, '')}", param=name,
                              code="unsupported_parameter")
        raise bad_request(f"unknown parameter {name!r}", param=name, code="unknown_parameter")


# message keys OpenAI defines that braid does not render -> why, and the values besides null that ask for nothing
_UNRENDERED_MESSAGE_KEYS = {"function_call": ("use tool_calls", ()),
                            "refusal": ("braid does not put refusals into the prompt", ("",)),
                            "audio": ("braid has no audio output to refer to", ())}


# content part type -> the keys its payload object may have (None: the payload is a string)
_CONTENT_PARTS = {"text": None, "image_url": ("url", "detail"), "video_url": ("frames", "url", "num_frames"),
                  "input_audio": ("data", "format", "url")}


_PART_SHAPES = {"text": '{"type": "text", "text": "..."}',
                "image_url": '{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail"?}}',
                "video_url": '{"type": "video_url", "video_url": {"frames": [url, ...]} or {"url", "num_frames"?}}',
                "input_audio": '{"type": "input_audio", "input_audio": {"data", "format"}}'}


def _check_message(message: ChatMessage, i: int) -> None:
    for key, value in (message.model_extra or {}).items():
        if value is not None:
            raise bad_request(f"unknown key {key!r} in messages.{i}", param=f"messages.{i}.{key}",
                              code="unknown_parameter")
    for key, (why, off_values) in _UNRENDERED_MESSAGE_KEYS.items():
        if not asks_for_nothing(getattr(message, key), off_values):
            raise bad_request(f"messages[{i}].{key} is not supported ({why})", param=f"messages.{i}.{key}",
                              code="unsupported_parameter")
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            _check_content_part(part, f"messages.{i}.content.{j}")


def _check_content_part(part: dict, where: str) -> None:
    """400 naming what is wrong with a content part's shape (its media are checked when loaded)."""
    kind = part.get("type")
    if not isinstance(kind, str) or kind not in _CONTENT_PARTS:
        raise bad_request(f"{where}: content part type {kind!r} is not supported (text, image_url, video_url, "
                          "input_audio)", param=f"{where}.type")
    for key in part:
        if key not in ("type", kind):
            raise bad_request(f"{where}: unknown key {key!r} in a content part of type {kind!r}; the shape is "
                              f"{_PART_SHAPES[kind]}", param=f"{where}.{key}", code="unknown_parameter")
    payload, keys = part.get(kind), _CONTENT_PARTS[kind]
    if keys is None:
        if not isinstance(payload, str):
            raise bad_request(f"{where}: content part 'text' needs a string 'text', got {json_type(payload)}",
                              param=f"{where}.text")
        return
    if not isinstance(payload, dict):
        raise bad_request(f"{where}: content part {kind!r} needs an object as {kind!r}, got "
                          f"{json_type(payload)}; the shape is {_PART_SHAPES[kind]}", param=f"{where}.{kind}")
    for key in payload:
        if key not in keys:
            raise bad_request(f"{where}: unknown key {key!r} in {kind} ({', '.join(keys)})",
                              param=f"{where}.{kind}.{key}", code="unknown_parameter")
    if kind == "image_url" and not isinstance(payload.get("url"), str):
        raise bad_request(f"{where}: image_url.url must be a string (a data URL: data:image/png;base64,...), got "
                          f"{json_type(payload.get('url'))}", param=f"{where}.image_url.url")
    if kind == "video_url":
        if ("frames" in payload) == ("url" in payload):
            raise bad_request(f"{where}: video_url needs exactly one of frames (a list of image URLs) and url (a video "
                              "file)", param=f"{where}.video_url")
        if "frames" in payload and "num_frames" in payload:
            raise bad_request(f"{where}: video_url.num_frames applies to a video file (url), not to frames",
                              param=f"{where}.video_url.num_frames")


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


def openai_sampling_overrides(req: _OpenAIRequest, serving: GrammarServing = GrammarServing()) -> dict:
    """Body keys that are SamplingParams fields, plus the OpenAI and vLLM names translated (`constraint_param`
    says which parameter a grammar came from); `serving`: what the server's grammar engine does."""
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
    constrain(req, d, serving)
    return d


def requested_n(req: _OpenAIRequest) -> int:
    """How many choices the client gets (n); the request samples best_of of them when that is larger."""
    n = req.extras().get("n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


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
