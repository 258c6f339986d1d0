"""Test helpers: produce a string matching a regex and a value matching a JSON schema.

Used by the scripted backend and the fake server so constrained gens return well-formed output
without a model.
"""

from __future__ import annotations

import json
from typing import Any

try:  # Python 3.11+
    import re._constants as sre_c
    import re._parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants as sre_c
    import sre_parse

_CATEGORY_CHAR = {
    sre_c.CATEGORY_DIGIT: "0", sre_c.CATEGORY_NOT_DIGIT: "a", sre_c.CATEGORY_SPACE: " ",
    sre_c.CATEGORY_NOT_SPACE: "a", sre_c.CATEGORY_WORD: "a", sre_c.CATEGORY_NOT_WORD: " ",
}


def _in_class(items: list, ch: str) -> bool:
    code = ord(ch)
    for op, av in items:
        if op is sre_c.LITERAL and av == code:
            return True
        if op is sre_c.RANGE and av[0] <= code <= av[1]:
            return True
        if op is sre_c.CATEGORY:
            digit, space, word = ch.isdigit(), ch.isspace(), ch.isalnum() or ch == "_"
            table = {sre_c.CATEGORY_DIGIT: digit, sre_c.CATEGORY_NOT_DIGIT: not digit,
                     sre_c.CATEGORY_SPACE: space, sre_c.CATEGORY_NOT_SPACE: not space,
                     sre_c.CATEGORY_WORD: word, sre_c.CATEGORY_NOT_WORD: not word}
            if table.get(av):
                return True
    return False


def _class_char(items: list) -> str:
    negate = bool(items) and items[0][0] is sre_c.NEGATE
    body = items[1:] if negate else items
    if not negate:
        op, av = body[0]
        if op is sre_c.LITERAL:
            return chr(av)
        if op is sre_c.RANGE:
            return chr(av[0])
        return _CATEGORY_CHAR[av]
    for ch in "a0 xZ_-.":
        if not _in_class(body, ch):
            return ch
    raise ValueError("cannot pick a character for a negated class")


def _emit(items: Any, groups: dict) -> str:
    out = []
    for op, av in items:
        if op is sre_c.LITERAL:
            out.append(chr(av))
        elif op is sre_c.NOT_LITERAL:
            out.append("a" if av != ord("a") else "b")
        elif op is sre_c.ANY:
            out.append("x")
        elif op is sre_c.IN:
            out.append(_class_char(av))
        elif op is sre_c.CATEGORY:
            out.append(_CATEGORY_CHAR[av])
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            n = max(lo, 1) if hi >= 1 else 0
            out.append("".join(_emit(sub, groups) for _ in range(n)))
        elif op is sre_c.SUBPATTERN:
            group, _, _, sub = av
            text = _emit(sub, groups)
            if group is not None:
                groups[group] = text
            out.append(text)
        elif op is sre_c.BRANCH:
            out.append(_emit(av[1][0], groups))
        elif op is sre_c.GROUPREF:
            out.append(groups.get(av, ""))
        elif op is sre_c.AT:
            continue
        elif op is getattr(sre_c, "ATOMIC_GROUP", None):
            out.append(_emit(av, groups))
        else:
            raise ValueError(f"regex construct {op} not supported by the example generator")
    return "".join(out)


def example_for_regex(pattern: str) -> str:
    return _emit(sre_parse.parse(pattern), {})


def instance_for_schema(schema: Any, root: Any = None) -> Any:
    if isinstance(schema, str):
        schema = json.loads(schema)
    root = root if root is not None else schema
    if schema is True or schema == {}:
        return "any"
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return instance_for_schema(node, root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return instance_for_schema(schema[key][0], root)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties", {})
        return {k: instance_for_schema(v, root) for k, v in props.items()}
    if kind == "array":
        n = max(schema.get("minItems", 1), 1)
        return [instance_for_schema(schema.get("items", {}), root) for _ in range(n)]
    if kind == "string":
        if "pattern" in schema:
            return example_for_regex(schema["pattern"])
        return "x" * max(schema.get("minLength", 4), 1)
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 1.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    raise ValueError(f"schema type {kind!r} not supported by the example generator")
