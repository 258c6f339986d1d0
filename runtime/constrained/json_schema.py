"""JSON schema (dict, JSON text or pydantic model class) and choice lists -> regex."""

from __future__ import annotations

import json

from .grammar_errors import GrammarError
from .schema_keywords import PLACEHOLDER_PREFIX, checked_schema

# outlines-core emits unbounded digit runs for integers, fractions and exponents; a sampled model at temperature 1
# can then spin on digits until max_tokens and leave truncated JSON. Bound each run (int64 has 19 digits).
_UNBOUNDED_DIGIT_RUNS = (("(0|[1-9][0-9]*)", "(0|[1-9][0-9]{0,18})"), (r"(\.[0-9]+)", r"(\.[0-9]{1,16})"),
                         ("[+-][0-9]+)", "[+-][0-9]{1,3})"))

# A free-form JSON object ({"type": "object"}, or response_format json_object): outlines-core's regex for it takes
# longer than any sane timeout to index, so use one that admits objects nested two levels deep (compiles in ~2 s).
_STR = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'
_NUM = r"-?(0|[1-9][0-9]{0,18})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?"
_SCALAR = f"({_STR}|{_NUM}|true|false|null)"
_VALUE_DEPTH2 = rf"({_SCALAR}|\[({_SCALAR}(,{_SCALAR})*)?\]|\{{({_STR}:{_SCALAR}(,{_STR}:{_SCALAR})*)?\}})"
GENERIC_OBJECT_REGEX = rf"\{{({_STR}:{_VALUE_DEPTH2}(,{_STR}:{_VALUE_DEPTH2})*)?\}}"
_ANNOTATION_KEYS = {"type", "title", "description", "$schema"}

# Characters with a meaning in Rust's regex syntax and in interegular's (Python-like) one.
_REGEX_META = set("\\.^$|?*+()[]{}-&~#")


def json_schema_to_regex(schema, whitespace_pattern: str | None = None) -> str:
    """Regex of the JSON texts the schema accepts. `whitespace_pattern=None` means compact JSON (no spaces)."""
    from outlines_core.json_schema import build_regex_from_schema

    text = schema_to_json_text(schema)
    parsed = json.loads(text)
    if parsed.get("type") == "object" and set(parsed) <= _ANNOTATION_KEYS:
        return GENERIC_OBJECT_REGEX
    if PLACEHOLDER_PREFIX in text:
        raise GrammarError(f"the JSON schema may not contain the text {PLACEHOLDER_PREFIX!r} (braid uses it internally)")
    rewritten, numeric_regexes = checked_schema(parsed)
    try:
        regex = build_regex_from_schema(json.dumps(rewritten), "" if whitespace_pattern is None else whitespace_pattern)
    except (ValueError, TypeError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GrammarError(f"unsupported JSON schema: {message}") from None
    for unbounded, bounded in _UNBOUNDED_DIGIT_RUNS:
        regex = regex.replace(unbounded, bounded)
    for placeholder, numeric in numeric_regexes.items():
        regex = regex.replace(f'"{placeholder}"', f"({numeric})")
    return regex


def schema_to_json_text(schema) -> str:
    if isinstance(schema, type):
        to_schema = getattr(schema, "model_json_schema", None)
        if to_schema is None:
            raise GrammarError(f"{schema.__name__} is not a pydantic model class; pass a JSON schema instead")
        schema = to_schema()
    if isinstance(schema, (str, bytes)):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise GrammarError(f"a JSON schema must be a JSON object, got {type(parsed).__name__}")
    try:
        return json.dumps(parsed)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the JSON schema cannot be serialized to JSON: {exc}") from None


def escape_regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def choices_to_regex(choices: list[str]) -> str:
    """Regex matching exactly one of `choices`."""
    if isinstance(choices, str) or not choices:
        raise GrammarError("choices must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("every choice must be a non-empty string")
    # Longest first: with leftmost-first alternation a choice listed after one of its prefixes could never match.
    ordered = sorted(dict.fromkeys(choices), key=len, reverse=True)
    return "(" + "|".join(escape_regex_literal(c) for c in ordered) + ")"
