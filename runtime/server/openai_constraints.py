"""An OpenAI request's output constraint: response_format (json_schema, json_object, structural_tag), vLLM's
guided_* parameters and structured_outputs, and braid's own grammar fields, checked (one source per request) and
translated into SamplingParams' regex / json_schema / ebnf / structural_tag."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from braid.runtime.sampling_params import GRAMMAR_FIELDS
from braid.runtime.server.errors import bad_request, json_type

if TYPE_CHECKING:
    from braid.runtime.server.openai_protocol import ResponseFormat, _OpenAIRequest


# vLLM's guided-decoding backend names: the server's grammar engine compiles every request whichever is named (the
# engine is chosen per server, not per request).
GUIDED_DECODING_BACKENDS = ("auto", "braid", "llguidance", "guidance", "outlines", "xgrammar", "lm-format-enforcer")




_JSON_SCHEMA_SPEC = {"name": str, "schema": (dict, bool), "strict": bool, "description": str}


def check_response_format(rf: ResponseFormat) -> None:
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
            raise bad_request(f"{param} must be {kind}, got {json_type(value)}", param=param)


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
            raise bad_request(f"{where} must be an object {{begin, schema, end}}, got {json_type(structure)}",
                              param=where)
        for key in structure:
            if key not in _STRUCTURE_KEYS:
                raise bad_request(f"unknown key {key!r} in {where} (begin, schema, end)", param=f"{where}.{key}",
                                  code="unknown_parameter")
        for key, kind in _STRUCTURE_KEYS.items():
            value = structure.get(key)
            if not isinstance(value, kind) or (key == "begin" and not value):
                what = {"begin": "a non-empty string", "schema": "a JSON schema (an object)", "end": "a string"}[key]
                raise bad_request(f"{where}.{key} must be {what}, got {json_type(value)}", param=f"{where}.{key}")
    if not rf.triggers or not all(isinstance(t, str) and t for t in rf.triggers):
        raise bad_request("response_format.triggers must be a non-empty list of non-empty strings",
                          param="response_format.triggers")


def _structural_tag_spec(rf: ResponseFormat) -> str:
    """A structural_tag response format as SamplingParams.structural_tag (the object itself, type included)."""
    if rf.format is not None:
        return json.dumps({"type": "structural_tag", "format": rf.format})
    return json.dumps({"type": "structural_tag", "structures": rf.structures, "triggers": rf.triggers})


@dataclass(frozen=True)
class GrammarServing:
    """What the server's grammar engine does whatever a request says (structured_outputs' options ask for it)."""

    fallback: bool = False  # a regex or schema the engine refuses goes to another (--grammar-backend auto)
    json_strict: bool = True  # an object schema silent on extra properties allows none (--grammar-json-strict)


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
        raise bad_request(f"structured_outputs must be an object, got {json_type(so)}", param="structured_outputs")
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if key not in _STRUCTURED_OUTPUT_KINDS and key not in _STRUCTURED_OUTPUT_OPTIONS:
            raise bad_request(f"unknown key {key!r} in structured_outputs ({', '.join(_STRUCTURED_OUTPUT_KINDS)}, "
                              f"{', '.join(_STRUCTURED_OUTPUT_OPTIONS)})", param=param, code="unknown_parameter")
        kind = bool if key == "json_object" else _STRUCTURED_OUTPUT_OPTIONS.get(key)
        if value is not None and kind is not None and not isinstance(value, kind):
            raise bad_request(f"{param} must be {'a boolean' if kind is bool else 'a string'}, got {json_type(value)}",
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
    """The parameters a request's output constraint comes from, in the order `constrain` reads them (a kind inside
    structured_outputs as `structured_outputs.<kind>`); more than one is a 400."""
    extras = req.extras()
    given = [k for k in _GRAMMAR_PARAMS if extras.get(k) is not None]
    so = _structured_outputs(extras)
    given += [f"structured_outputs.{k}" for k in _STRUCTURED_OUTPUT_KINDS if k in so]
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        given.append("response_format")
    return given


def constrain(req: _OpenAIRequest, d: dict, serving: GrammarServing) -> None:
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
    from braid.runtime.constrained.grammar_errors import GrammarError
    from braid.runtime.constrained.json_schema import choices_to_regex

    if not isinstance(choices, list):
        raise bad_request(f"{param} must be a list of strings", param=param)
    try:
        return choices_to_regex(choices)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param=param) from None


def _schema_regex(schema: Any, whitespace: str, param: str) -> str:
    from braid.runtime.constrained.grammar_errors import GrammarError
    from braid.runtime.constrained.json_schema import json_schema_to_regex

    try:
        return json_schema_to_regex(schema, whitespace)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param=param) from None
