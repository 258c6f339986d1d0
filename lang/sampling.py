"""The DSL's sampling keywords, derived from SamplingParams (never a hand-copied field list).

The DSL spells a few fields differently from SamplingParams (gen's `max_tokens` is
`max_new_tokens`, SGLang's `min_tokens` is `min_new_tokens`); everything else is the SamplingParams field name itself.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from braid import ir
from braid.errors import ProgramError
from braid.runtime.sampling_params import SamplingParams, SamplingParamsError

# DSL keyword -> SamplingParams field
RENAMES: dict[str, str] = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}

FIELD_NAMES: frozenset[str] = frozenset(SamplingParams.field_names())
DSL_KEYWORDS: frozenset[str] = frozenset(RENAMES) | FIELD_NAMES


def is_sampling_keyword(name: str) -> bool:
    return name in DSL_KEYWORDS


def to_field_overrides(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """DSL keywords -> {SamplingParams field: value}, None values dropped, unknown names rejected."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key not in DSL_KEYWORDS:
            raise ProgramError(f"unknown sampling parameter {key!r}")
        if value is None:
            continue
        field_name = RENAMES.get(key, key)
        if field_name in out and out[field_name] != value:
            raise ProgramError(f"sampling parameter {field_name!r} given twice ({key!r})")
        out[field_name] = value
    return out


def pick_sampling_keywords(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `namespace` (e.g. a function's locals) that are DSL sampling keywords."""
    return {k: v for k, v in namespace.items() if k in DSL_KEYWORDS}


def merge(base: SamplingParams, overrides: Mapping[str, Any]) -> SamplingParams:
    """`base` with field overrides applied; invalid values become a ProgramError."""
    try:
        sp = base.merged(**overrides)
        sp.verify()
    except SamplingParamsError as e:
        raise ProgramError(str(e)) from None
    return sp


def defaults_from_keywords(kwargs: Mapping[str, Any], base: SamplingParams | None = None) -> SamplingParams:
    return merge(base or SamplingParams(), to_field_overrides(kwargs))


def schema_to_json(schema: Any) -> str:
    """A JSON-schema given as dict, JSON string or pydantic model class -> JSON string."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as e:
            raise ProgramError(f"json_schema is not valid JSON: {e}") from None
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return json.dumps(schema.model_json_schema())
    raise ProgramError("json_schema must be a dict, a JSON string or a pydantic model class, "
                       f"got {type(schema).__name__}")


# dtype -> (regex constraining the output, converter of the output text); the regexes live in braid.ir
def _to_bool(text: str) -> bool:
    return text.strip() == "True"


def _to_str(text: str) -> str:
    try:
        return json.loads(text)
    except ValueError:
        return text.strip().strip('"')


DTYPES: dict[type, tuple[str, Any]] = {
    int: (ir.REGEX_INT, lambda t: int(t.strip())),
    float: (ir.REGEX_FLOAT, lambda t: float(t.strip())),
    bool: (ir.REGEX_BOOL, _to_bool),
    str: (ir.REGEX_STR, _to_str),
}


# SGLang also spells dtypes as strings
DTYPE_NAMES: dict[str, type] = {t.__name__: t for t in DTYPES}


def dtype_regex(dtype: type) -> str:
    if dtype not in DTYPES:
        raise ProgramError(f"gen dtype must be one of int, float, bool, str; got {dtype!r}")
    return DTYPES[dtype][0]


def convert_dtype(dtype: type, text: str) -> Any:
    try:
        return DTYPES[dtype][1](text)
    except ValueError as e:
        raise ProgramError(f"generated text {text!r} is not a valid {dtype.__name__}: {e}") from None
