"""JSON schemas as braid's llguidance engine generates under them: patterns' shorthand classes as ASCII, and the
strict mode (--grammar-json-strict) that narrows a schema as XGrammar's strict mode does in SGLang and vLLM."""

from __future__ import annotations

from .regex_classes import ascii_shorthand_classes

# values that are data, not subschemas: never rewritten
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})
# subschemas whose narrowing would widen what the whole accepts (strict_schema leaves them as they are)
_NOT_NARROWED = frozenset({"not", "if", "oneOf"})


_INT_BOUNDS = (-(10**18 - 1), 10**18 - 1)  # at most 18 digits: within 64 bits (llguidance's range regex stops short)
_FRACTION_STEP = 1e-9  # at most 9 decimals (llguidance takes no finer multipleOf)


def ascii_patterns(schema):
    """`schema` with every `pattern` and `patternProperties` key's \\d, \\w, \\s as ASCII classes (regex_classes.py:
    Rust's are Unicode; SGLang and vLLM mean ASCII)."""
    if isinstance(schema, list):
        return [ascii_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = ascii_shorthand_classes(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ascii_shorthand_classes(k): ascii_patterns(v) for k, v in value.items()}
        elif key in ("properties", "$defs", "definitions", "dependentSchemas") and isinstance(value, dict):
            out[key] = {name: ascii_patterns(sub) for name, sub in value.items()}
        else:
            out[key] = ascii_patterns(value)
    return out


def _mentions(schema, keys: frozenset) -> bool:
    if isinstance(schema, dict):
        return bool(keys & schema.keys()) or any(_mentions(v, keys) for v in schema.values())
    if isinstance(schema, list):
        return any(_mentions(v, keys) for v in schema)
    return False


def strict_schema(schema, branch: bool = False, defs_too: bool | None = None):
    """`schema` narrowed as SGLang and vLLM (XGrammar's strict mode) generate: `additionalProperties: false` on every
    object schema that says nothing of extra properties, and numbers without bounds kept to 18 integer digits and 9
    decimals (no exponent). Every output still validates; a model cannot invent keys or run a number on until
    max_tokens.

    Narrowing is sound only where it narrows the whole: never inside `not`, `if` or `oneOf` (a narrower branch can
    turn an instance two branches matched into one that only one matches), and an object that is a branch of
    `allOf` / `anyOf` or combines others (allOf, anyOf, oneOf, $ref) is not closed, or the branches' own
    properties would exclude each other. `branch`: `schema` is an item of allOf / anyOf. Definitions ($defs) are
    narrowed only where no `not`, `if` or `oneOf` could refer to them (`defs_too`, found on the root)."""
    if not isinstance(schema, dict):
        return schema
    if defs_too is None:
        defs_too = not _mentions(schema, _NOT_NARROWED)
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS or key in _NOT_NARROWED or (key in ("$defs", "definitions") and not defs_too):
            out[key] = value
        elif key in ("allOf", "anyOf") and isinstance(value, list):
            out[key] = [strict_schema(sub, True, defs_too) for sub in value]
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = {name: strict_schema(sub, False, defs_too) for name, sub in value.items()} \
                if isinstance(value, dict) else value
        elif isinstance(value, list):
            out[key] = [strict_schema(sub, False, defs_too) for sub in value]
        else:
            out[key] = strict_schema(value, False, defs_too)
    is_object = out.get("type") == "object" or "properties" in out
    combines = {"allOf", "anyOf", "oneOf", "$ref"} & out.keys()
    if is_object and not branch and not combines and \
            not {"additionalProperties", "unevaluatedProperties", "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    if out.get("type") in ("integer", "number"):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = _INT_BOUNDS[0]
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _INT_BOUNDS[1]
    if out.get("type") == "number" and "multipleOf" not in out:
        out["multipleOf"] = _FRACTION_STEP
    return out
