"""The llguidance engine's strict mode (--grammar-json-strict, on by default) only narrows a schema: whatever the
narrowed schema accepts, the schema as written accepts too (checked with jsonschema), and it never narrows inside
not / if / oneOf, or closes an object another schema combines with."""

from __future__ import annotations

import json

import jsonschema
import pytest

from braid.runtime.constrained.schema_strict import strict_schema

CASES = [
    # (schema, instances to judge under both)
    ({"type": "object", "properties": {"a": {"type": "integer"}}},
     [{"a": 1}, {"a": 1, "b": 2}, {}, {"a": 10**19}]),
    ({"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"b": {"type": "integer"}}}]},
     [{"a": "x", "b": 1}, {"a": "x"}, {"c": 1}]),
    ({"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
      "$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                "B": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
     [{"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {}]),
    ({"type": "object", "not": {"type": "object", "properties": {"x": {"type": "integer"}}}},
     [{"x": 1}, {"y": 1}, {}]),
    ({"if": {"type": "object", "properties": {"k": {"const": 1}}}, "then": {"required": ["v"]}},
     [{"k": 1}, {"k": 1, "v": 0}, {"k": 2, "z": 0}]),
    ({"anyOf": [{"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "integer"}}}}},
                {"type": "integer"}]},
     [{"p": {"q": 1}}, {"p": {"q": 1, "r": 2}}, 3, {"p": {}}]),
]


@pytest.mark.parametrize("schema,instances", CASES)
def test_strict_schema_only_narrows(schema, instances):
    narrowed = strict_schema(schema)
    for instance in instances:
        if jsonschema.Draft202012Validator(narrowed).is_valid(instance):
            assert jsonschema.Draft202012Validator(schema).is_valid(instance), (narrowed, instance)


def test_what_strict_mode_changes_and_leaves():
    plain = strict_schema({"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": "integer",
                                                                                             "minimum": 0}}})
    assert plain["additionalProperties"] is False
    assert plain["properties"]["n"] == {"type": "integer", "minimum": -(10**18 - 1), "maximum": 10**18 - 1}
    assert plain["properties"]["m"]["minimum"] == 0
    assert strict_schema({"type": "number"})["multipleOf"] == 1e-9
    combined = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert strict_schema(combined) == combined  # branches of one object are not closed against each other
    with_one_of = CASES[2][0]
    assert strict_schema(with_one_of) == with_one_of  # definitions a oneOf refers to stay as written
    assert strict_schema({"not": {"type": "integer"}}) == {"not": {"type": "integer"}}
    data = {"enum": [{"type": "object"}], "const": {"properties": {}}}
    assert strict_schema(data) == data
    assert json.loads(json.dumps(strict_schema({"additionalProperties": True, "properties": {}}))) == {
        "additionalProperties": True, "properties": {}}
