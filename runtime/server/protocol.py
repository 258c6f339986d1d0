"""Request schemas of the native and OpenAI APIs: their shape, and the sampling-field dicts they carry.

Sampling fields are never listed here: whatever body key is a SamplingParams field name is handed to
`prepare_request` (runtime/request_io/prepare.py), which builds and checks the SamplingParams; only the
OpenAI and vLLM names that differ (max_tokens, min_tokens, response_format, best_of, guided_*,
structured_outputs, include_stop_str_in_output) are translated. A top-level OpenAI parameter that is none of these is a 400
(`_check_parameter_names`); docs/api.md lists what is accepted and what is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from braid.runtime.sampling_params import GRAMMAR_FIELDS, MAX_TOP_LOGPROBS, SamplingParams
from braid.runtime.server.errors import APIError, bad_request

SAMPLING_FIELDS = frozenset(SamplingParams.field_names())

# ---- OpenAI schemas ---------------------------------------------------------------------------


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
# vLLM's guided-decoding backend names: the server's grammar engine compiles every request whichever is named (the
# engine is chosen per server, not per request).
GUIDED_DECODING_BACKENDS = ("auto", "braid", "llguidance", "guidance", "outlines", "xgrammar", "lm-format-enforcer")
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
        _check_response_format(req.response_format)
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
                raise bad_request(f"{name} must be a string, got {_json_type(value)}", param=name)
            continue
        if name in NOT_SUPPORTED:
            if _asks_for_nothing(value, NOT_SUPPORTED[name]):
                continue
            raise bad_request(f"{name} is not supported{_WHY_NOT.get(name, '')}", param=name,
                              code="unsupported_parameter")
        raise bad_request(f"unknown parameter {name!r}", param=name, code="unknown_parameter")


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _asks_for_nothing(value: Any, off_values: tuple) -> bool:
    """null, or one of `off_values` (a boolean matches only a boolean: 0 is no `false`)."""
    return value is None or any(value == off and isinstance(value, bool) == isinstance(off, bool)
                                for off in off_values)


_JSON_SCHEMA_SPEC = {"name": str, "schema": (dict, bool), "strict": bool, "description": str}


def _check_response_format(rf: ResponseFormat) -> None:
    """json_schema only with type json_schema, holding only OpenAI's keys (name and description are labels, like a
    schema's annotations; strict: braid always enforces the schema); structures, triggers and format only with type
    structural_tag."""
    _check_structural_tag_format(rf)
    if rf.json_schema is None:
        return
    if rf.type != "json_schema":
        raise bad_request(f"response_format.json_schema applies only to type 'json_schema', not {rf.type!r}",
                          param="response_format.json_schema")
    for key, value in rf.json_schema.items():
        param = f"response_format.json_schema.{key}"
        if key not in _JSON_SCHEMA_SPEC:
            raise bad_request(f"unknown key {key!r} in response_format.json_schema (name, schema, strict, "
                              "description)", param=param, code="unknown_parameter")
        expected = _JSON_SCHEMA_SPEC[key]
        if value is not None and (not isinstance(value, expected) or (expected is str and isinstance(value, bool))):
            kind = "an object" if key == "schema" else "a boolean" if expected is bool else "a string"
            raise bad_request(f"{param} must be {kind}, got {_json_type(value)}", param=param)


_STRUCTURE_KEYS = {"begin": str, "schema": (dict, bool), "end": str}


def _check_structural_tag_format(rf: ResponseFormat) -> None:
    """The shape of a structural_tag response format (what its structures and format say is the engine's to judge)."""
    given = [k for k in ("structures", "triggers", "format") if getattr(rf, k) is not None]
    if rf.type != "structural_tag":
        if given:
            raise bad_request(f"response_format.{given[0]} applies only to type 'structural_tag', not {rf.type!r}",
                              param=f"response_format.{given[0]}")
        return
    if rf.format is not None:
        if given != ["format"]:
            raise bad_request("response_format of type 'structural_tag' takes either format or structures with "
                              "triggers, not both", param=f"response_format.{given[0]}")
        return
    if rf.structures is None or rf.triggers is None:
        raise bad_request("response_format of type 'structural_tag' needs format, or structures and triggers",
                          param="response_format.structures" if rf.structures is None else "response_format.triggers")
    if not rf.structures:
        raise bad_request("response_format.structures must not be empty", param="response_format.structures")
    for i, structure in enumerate(rf.structures):
        where = f"response_format.structures.{i}"
        if not isinstance(structure, dict):
            raise bad_request(f"{where} must be an object {{begin, schema, end}}, got {_json_type(structure)}",
                              param=where)
        for key in structure:
            if key not in _STRUCTURE_KEYS:
                raise bad_request(f"unknown key {key!r} in {where} (begin, schema, end)", param=f"{where}.{key}",
                                  code="unknown_parameter")
        for key, kind in _STRUCTURE_KEYS.items():
            value = structure.get(key)
            if not isinstance(value, kind) or (key == "begin" and not value):
                what = {"begin": "a non-empty string", "schema": "a JSON schema (an object)", "end": "a string"}[key]
                raise bad_request(f"{where}.{key} must be {what}, got {_json_type(value)}", param=f"{where}.{key}")
    if not rf.triggers or not all(isinstance(t, str) and t for t in rf.triggers):
        raise bad_request("response_format.triggers must be a non-empty list of non-empty strings",
                          param="response_format.triggers")


def _structural_tag_spec(rf: ResponseFormat) -> str:
    """A structural_tag response format as SamplingParams.structural_tag (the object itself, type included)."""
    if rf.format is not None:
        return json.dumps({"type": "structural_tag", "format": rf.format})
    return json.dumps({"type": "structural_tag", "structures": rf.structures, "triggers": rf.triggers})


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
        if not _asks_for_nothing(getattr(message, key), off_values):
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
            raise bad_request(f"{where}: content part 'text' needs a string 'text', got {_json_type(payload)}",
                              param=f"{where}.text")
        return
    if not isinstance(payload, dict):
        raise bad_request(f"{where}: content part {kind!r} needs an object as {kind!r}, got "
                          f"{_json_type(payload)}; the shape is {_PART_SHAPES[kind]}", param=f"{where}.{kind}")
    for key in payload:
        if key not in keys:
            raise bad_request(f"{where}: unknown key {key!r} in {kind} ({', '.join(keys)})",
                              param=f"{where}.{kind}.{key}", code="unknown_parameter")
    if kind == "image_url" and not isinstance(payload.get("url"), str):
        raise bad_request(f"{where}: image_url.url must be a string (a data URL: data:image/png;base64,...), got "
                          f"{_json_type(payload.get('url'))}", param=f"{where}.image_url.url")
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


@dataclass(frozen=True)
class GrammarServing:
    """What the server's grammar engine does whatever a request says (structured_outputs' options ask for it)."""

    fallback: bool = False  # a regex or schema the engine refuses goes to another (--grammar-backend auto)
    json_strict: bool = True  # an object schema silent on extra properties allows none (--grammar-json-strict)


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
    _constraint(req, d, serving)
    return d


def requested_n(req: _OpenAIRequest) -> int:
    """How many choices the client gets (n); the request samples best_of of them when that is larger."""
    n = req.extras().get("n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


# vLLM's structured_outputs object: the grammar kinds it may hold (one per request), then its options
_STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_STRUCTURED_OUTPUT_OPTIONS = {"whitespace_pattern": str, "disable_fallback": bool, "disable_any_whitespace": bool,
                              "disable_additional_properties": bool}
# top-level parameters that carry a grammar: SamplingParams' own fields, then vLLM's names
_GRAMMAR_PARAMS = GRAMMAR_FIELDS + ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _structured_outputs(extras: dict, serving: GrammarServing = GrammarServing()) -> dict:
    """vLLM's structured_outputs checked: its keys that ask for something (not null, not false); an option the
    server's engine does not do (`serving`) is a 400."""
    so = extras.get("structured_outputs")
    if so is None:
        return {}
    if not isinstance(so, dict):
        raise bad_request(f"structured_outputs must be an object, got {_json_type(so)}", param="structured_outputs")
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if key not in _STRUCTURED_OUTPUT_KINDS and key not in _STRUCTURED_OUTPUT_OPTIONS:
            raise bad_request(f"unknown key {key!r} in structured_outputs ({', '.join(_STRUCTURED_OUTPUT_KINDS)}, "
                              f"{', '.join(_STRUCTURED_OUTPUT_OPTIONS)})", param=param, code="unknown_parameter")
        kind = bool if key == "json_object" else _STRUCTURED_OUTPUT_OPTIONS.get(key)
        if value is not None and kind is not None and not isinstance(value, kind):
            raise bad_request(f"{param} must be {'a boolean' if kind is bool else 'a string'}, got {_json_type(value)}",
                              param=param)
    if so.get("disable_fallback") and serving.fallback:
        raise bad_request("structured_outputs.disable_fallback: this server's grammar engine is auto (llguidance, "
                          "falling back to outlines-core for a regex or schema llguidance refuses); the engine is "
                          "chosen per server (--grammar-backend)", param="structured_outputs.disable_fallback",
                          code="unsupported_parameter")
    if so.get("disable_additional_properties") and not serving.json_strict:
        raise bad_request("structured_outputs.disable_additional_properties: this server lets an object schema silent "
                          "on extra properties have any (--grammar-json-strict off); give the schema "
                          '"additionalProperties": false', param="structured_outputs.disable_additional_properties",
                          code="unsupported_parameter")
    return {k: v for k, v in so.items() if v is not None and v is not False}


def grammar_sources(req: _OpenAIRequest) -> list[str]:
    """The parameters a request's output constraint comes from, in the order _constraint reads them (a kind inside
    structured_outputs as `structured_outputs.<kind>`); more than one is a 400."""
    extras = req.extras()
    given = [k for k in _GRAMMAR_PARAMS if extras.get(k) is not None]
    so = _structured_outputs(extras)
    given += [f"structured_outputs.{k}" for k in _STRUCTURED_OUTPUT_KINDS if k in so]
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        given.append("response_format")
    return given


def _constraint(req: _OpenAIRequest, d: dict, serving: GrammarServing) -> None:
    """At most one grammar source (grammar_sources) -> d's regex, json_schema, ebnf or structural_tag. A whitespace
    pattern (guided_whitespace_pattern, structured_outputs' whitespace_pattern or disable_any_whitespace) turns a
    JSON schema into a regex here, with that whitespace."""
    extras = req.extras()
    given = grammar_sources(req)
    if len(given) > 1:
        raise bad_request(f"{given[0]} and {given[1]} cannot be combined (one output constraint per request)",
                          param=given[0])
    backend = extras.get("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_DECODING_BACKENDS:
        raise bad_request(f"guided_decoding_backend must be one of {', '.join(GUIDED_DECODING_BACKENDS)} (the "
                          f"server's grammar engine compiles every request), got {backend!r}",
                          param="guided_decoding_backend")
    so = _structured_outputs(extras, serving)
    source = given[0] if given else None
    if source is not None and source not in GRAMMAR_FIELDS:
        kind = source.split(".", 1)[1] if source.startswith("structured_outputs.") else source
        value = so.get(kind) if source.startswith("structured_outputs.") else extras.get(source)
        if kind in ("guided_json", "json"):
            d["json_schema"] = _json_schema_value(value, source)
        elif kind in ("guided_regex", "regex"):
            d["regex"] = _non_empty_string(value, source)
        elif kind in ("guided_choice", "choice"):
            d["regex"] = _choice_regex(value, source)
        elif kind in ("guided_grammar", "grammar"):
            d["ebnf"] = _non_empty_string(value, source)
        elif kind == "json_object":
            d["json_schema"] = {"type": "object"}
        elif kind == "structural_tag":
            d["structural_tag"] = value
        else:
            _response_format(req.response_format, d)
    _whitespace(extras, so, d, source)


def _response_format(rf: ResponseFormat, d: dict) -> None:
    if rf.type == "json_object":
        d["json_schema"] = {"type": "object"}
    elif rf.type == "structural_tag":
        d["structural_tag"] = _structural_tag_spec(rf)
    else:
        spec = rf.json_schema or {}
        schema = spec.get("schema")
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required", param="response_format")
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema must be an object", param="response_format")
        d["json_schema"] = json.dumps(schema)


def _whitespace(extras: dict, so: dict, d: dict, source: Optional[str]) -> None:
    patterns = {"guided_whitespace_pattern": extras.get("guided_whitespace_pattern"),
                "structured_outputs.whitespace_pattern": so.get("whitespace_pattern"),
                "structured_outputs.disable_any_whitespace": "" if so.get("disable_any_whitespace") else None}
    given = [k for k, v in patterns.items() if v is not None]
    if not given:
        return
    if len(given) > 1:
        raise bad_request(f"{given[0]} and {given[1]} cannot be combined", param=given[0])
    param, whitespace = given[0], patterns[given[0]]
    if not isinstance(whitespace, str):
        raise bad_request(f"{param} must be a string", param=param)
    if d.get("json_schema") is None:
        raise bad_request(f"{param} applies to a JSON schema (guided_json, json_schema, structured_outputs.json or "
                          "response_format)", param=param)
    d["regex"] = _schema_regex(d.pop("json_schema"), whitespace, source or "json_schema")


def constraint_param(req: _OpenAIRequest) -> Optional[str]:
    """The parameter a request's output constraint came from when it is no SamplingParams field (for errors found
    later, e.g. by the compiler, which name the field)."""
    given = grammar_sources(req)
    return given[0] if given and given[0] not in GRAMMAR_FIELDS else None


def _non_empty_string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{param} must be a non-empty string", param=param)
    return value


def _json_schema_value(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param}: not valid JSON ({e})", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object), got {type(value).__name__}", param=param)
    return json.dumps(value)


def _choice_regex(choices: Any, param: str) -> str:
    from braid.runtime.constrained.fsm import GrammarError
    from braid.runtime.constrained.json_schema import choices_to_regex

    if not isinstance(choices, list):
        raise bad_request(f"{param} must be a list of strings", param=param)
    try:
        return choices_to_regex(choices)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param=param) from None


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
    return_text_in_logprobs: bool = False  # each logprob entry gets its token's text
    rids: Optional[list[str]] = None
    image_data: list[Any] = field(default_factory=list)  # one entry per prompt
    is_video: bool = False  # modalities says image_data holds video frames
    video_data: list[Any] = field(default_factory=list)  # one entry per prompt: a video (frames) or a list of them
    lora_paths: list[Optional[str]] = field(default_factory=list)  # one LoRA adapter name (or None) per prompt


_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "rid", "image_data", "return_text_in_logprobs", "modalities", "video_data",
                  "lora_path"}


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

    rids = request_ids(body.get("rid"), len(prompts))

    modalities = body.get("modalities")
    if modalities is not None and not (isinstance(modalities, list) and all(m in _MODALITIES for m in modalities)):
        raise bad_request(f"modalities must be a list of {', '.join(_MODALITIES)}", param="modalities")
    if "video" in (modalities or ()) and body.get("video_data") is not None:
        raise bad_request("give a video either as video_data or as image_data with modalities ['video'], not both",
                          param="video_data")
    images = _per_prompt(body.get("image_data"), is_batch, len(prompts))
    videos = _per_prompt(body.get("video_data"), is_batch, len(prompts))

    for name in ("stream", "return_logprob", "return_text_in_logprobs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name} must be a boolean, got {_json_type(body[name])}", param=name)
    return_logprob = bool(body.get("return_logprob"))
    if not return_logprob:
        for name, off in _LOGPROB_OPTIONS.items():
            if not _asks_for_nothing(body.get(name), (off,)):
                raise bad_request(f"{name} needs return_logprob to be true", param=name)
    return GenerateRequest(prompts=prompts, is_batch=is_batch, sampling_params=sps, stream=bool(body.get("stream")),
                           return_logprob=return_logprob,
                           logprob_start_len=_or_default(body.get("logprob_start_len"), -1),
                           top_logprobs_num=_or_default(body.get("top_logprobs_num"), 0),
                           return_text_in_logprobs=bool(body.get("return_text_in_logprobs")), rids=rids,
                           image_data=images, is_video="video" in (modalities or ()), video_data=videos,
                           lora_paths=_lora_paths(body.get("lora_path"), len(prompts)))


def _lora_paths(value: Any, count: int) -> list[Optional[str]]:
    """/generate's lora_path (SGLang's name): one adapter name for every prompt, or a list with one (or null) per
    prompt. Whether the name is served is prepare_request's check."""
    if value is None or isinstance(value, str):
        return [value] * count
    if isinstance(value, list) and len(value) == count and all(v is None or isinstance(v, str) for v in value):
        return list(value)
    raise bad_request(f"lora_path must be an adapter name or a list of {count} names (or nulls), one per prompt",
                      param="lora_path")


# /generate's options that only shape the logprobs return_logprob asks for -> their value that asks for nothing
_LOGPROB_OPTIONS = {"top_logprobs_num": 0, "logprob_start_len": -1, "return_text_in_logprobs": False}


def _or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def request_ids(rid: Any, count: int) -> Optional[list[str]]:
    """`rid` of /generate and /v1/completions: one non-empty string per prompt, all distinct; for one prompt a
    string (or a list of one), for a batch a list (a single string would name several requests)."""
    if rid is None:
        return None
    if isinstance(rid, str) and count > 1:
        raise bad_request(f"a batch of {count} prompts needs rid as a list of {count} strings, one per prompt",
                          param="rid")
    rids = [rid] if isinstance(rid, str) else rid
    if not (isinstance(rids, list) and all(isinstance(r, str) and r for r in rids) and len(rids) == count):
        raise bad_request("rid must be a non-empty string (or a list with one non-empty string per prompt)",
                          param="rid")
    if len(set(rids)) != len(rids):
        raise bad_request("rid values must be distinct", param="rid")
    return rids


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
