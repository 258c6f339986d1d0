"""prepare_schema: annotations dropped at schema positions only, refused keywords rewritten into enforced ones with
the same meaning (checked against the `jsonschema` validator), the rest left for the engine to refuse by name."""

import json
import random
import re

import jsonschema
import pytest

from braid.runtime.constrained.grammar_errors import GrammarError
from braid.runtime.constrained.schema_prepare import _not_words, prepare_schema


def same_meaning(schema, instances):
    """Every instance is valid under `schema` exactly when it is under prepare_schema(schema)."""
    prepared = prepare_schema(schema)
    original = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    after = jsonschema.validators.validator_for(prepared, default=jsonschema.Draft202012Validator)(prepared) \
        if isinstance(prepared, dict) else original
    for x in instances:
        assert original.is_valid(x) == after.is_valid(x), (json.dumps(x), json.dumps(prepared))
    return prepared


def walk_keys(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield k
            yield from walk_keys(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk_keys(v)


def test_annotations_and_unknown_keywords_dropped_but_never_property_names_or_data():
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#", "$comment": "c", "title": "T", "description": "d",
        "x-vendor": {"a": 1}, "links": [], "preferredOrder": ["id"], "name": "thing", "readonly": True,
        "type": "object",
        "properties": {
            "id": {"type": "string", "title": "the id", "examples": ["a"], "default": "a", "_format": "x"},
            "title": {"enum": [{"title": "kept", "description": "data"}]},
            "name": {"const": {"$comment": "data too"}, "readOnly": True},
        },
        "required": ["id"],
        "definitions": {"unused": {"description": "gone", "type": "integer"}},
    }
    out = prepare_schema(schema)
    assert out == {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"id": {"type": "string"}, "title": {"enum": [{"title": "kept", "description": "data"}]},
                       "name": {"const": {"$comment": "data too"}}},
        "required": ["id"], "definitions": {"unused": {"type": "integer"}},
    }
    assert schema["properties"]["id"]["title"] == "the id"  # the caller's schema is not modified


def test_refs_into_unknown_keywords_keep_their_targets():
    schema = {"components": {"schemas": {"A": {"type": "integer", "description": "x"}}, "other": 1},
              "properties": {"a": {"$ref": "#/components/schemas/A"}}}
    out = prepare_schema(schema)
    assert out["components"] == {"schemas": {"A": {"type": "integer"}}}
    same_meaning(schema, [{"a": 1}, {"a": "x"}, {}])


def test_draft3_required_flags_and_keywords():
    schema = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "object",
              "properties": {"a": {"type": "integer", "required": True, "divisibleBy": 2},
                             "b": {"type": "string", "required": False}},
              "extends": {"properties": {"c": {"type": "boolean"}}}}
    out = prepare_schema(schema)
    assert out["$schema"] == "http://json-schema.org/draft-04/schema#"
    assert out["required"] == ["a"] and out["properties"]["a"] == {"type": "integer", "multipleOf": 2}
    assert out["allOf"] == [{"properties": {"c": {"type": "boolean"}}}]
    with pytest.raises(GrammarError, match="disallow"):
        prepare_schema({"$schema": "http://json-schema.org/draft-03/schema", "disallow": "string"})


@pytest.mark.parametrize("uri, expected", [
    ("http://json-schema.org/draft-04/schema", "http://json-schema.org/draft-04/schema#"),
    ("https://json-schema.org/draft-07/schema", "http://json-schema.org/draft-07/schema#"),
    ("https://json-schema.org/draft/2019-09/schema#", "https://json-schema.org/draft/2019-09/schema"),
    ("http://json-schema.org/schema#", None),
    ("https://example.com/my-meta-schema", None),
])
def test_schema_uris_the_engine_would_fetch_are_normalized_or_dropped(uri, expected):
    out = prepare_schema({"$schema": uri, "type": "string"})
    assert out.get("$schema") == expected and out["type"] == "string"


def test_formats():
    out = prepare_schema({"properties": {"a": {"type": "string", "format": "date"},
                                         "b": {"type": "string", "format": "path"},
                                         "c": {"type": "string", "format": "uri-reference"},
                                         "d": {"type": "string", "format": "json-pointer"}}})
    props = out["properties"]
    assert props["a"]["format"] == "date"  # the engine enforces it
    assert "format" not in props["b"]  # no such format in the specification: an annotation
    assert props["c"]["format"] == "uri-reference"  # a standard format the engine lacks: left for it to refuse
    ptr = re.compile(props["d"]["pattern"])
    assert ptr.match("/a~1b/0") and ptr.match("") and not ptr.match("a") and not ptr.match("/~2")


def test_x_guidance_keeps_only_formatting_options():
    out = prepare_schema({"x-guidance": {"lenient": True, "coerce_one_of": True, "whitespace_flexible": False},
                          "type": "string"})
    assert out["x-guidance"] == {"whitespace_flexible": False}


def test_unique_items_dropped_only_where_it_cannot_matter():
    assert "uniqueItems" not in prepare_schema({"type": "array", "uniqueItems": False})
    assert "uniqueItems" not in prepare_schema({"type": "array", "uniqueItems": True, "maxItems": 1})
    assert prepare_schema({"type": "array", "uniqueItems": True})["uniqueItems"] is True


def test_keywords_a_declared_draft_lacks_are_ignored_as_it_says():
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    out = same_meaning(schema, [{"a": 1}, {"a": 1, "b": 2}, {}])
    assert not {"if", "then", "allOf"} & out.keys()


INSTANCES = [None, True, False, 0, 1, 2, 2.5, -3, 10, "", "a", "ab", "abc", "x", "action", [], [1], [1, 2, 3],
             {}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"a": "x"}, {"a": 1, "b": 2, "c": 3}, {"kind": "circle"},
             {"kind": "circle", "r": 1}, {"kind": "square", "side": 2}, {"kind": "square", "r": 1},
             {"kind": "other"}, {"kind": 3}, {"radius": 1}, {"length": 1, "width": 2}, {"radius": 1, "length": 2},
             {"radius": 1, "length": 2, "width": 3}, {"a": None}, {"a": [1, 2]}]


@pytest.mark.parametrize("schema", [
    {"not": {"type": "string"}},
    {"not": {"type": ["object", "array"]}},
    {"not": {}},
    {"not": {"required": ["a"]}},
    {"not": {"required": ["a", "b"]}},
    {"not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    {"not": {"allOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    {"not": {"not": {"type": "integer", "minimum": 2}}},
    {"not": {"enum": ["a", "ab", 1, True, None]}},
    {"not": {"const": "action"}},
    {"type": "string", "not": {"enum": ["", "a"]}},
    {"not": {"minimum": 1, "maximum": 2}},
    {"not": {"exclusiveMinimum": 1}},
    {"$schema": "http://json-schema.org/draft-04/schema#", "not": {"minimum": 2, "exclusiveMinimum": True}},
    {"not": {"minLength": 2, "maxLength": 2}},
    {"not": {"minItems": 1, "maxItems": 2}},
    {"not": {"properties": {"a": {"type": "string"}}}},
    {"not": {"$ref": "#/$defs/int"}, "$defs": {"int": {"type": "number", "minimum": 1}}},
    {"if": {"properties": {"kind": {"const": "circle"}}, "required": ["kind"]},
     "then": {"required": ["r"]}, "else": {"not": {"required": ["r"]}}},
    {"if": {"properties": {"a": {"type": "string"}}}, "then": {"required": ["b"]}},
    {"if": {"required": ["a"]}, "else": {"required": ["b"]}},
    # `dependencies` is a keyword up to draft-07 (braid enforces it in later drafts too, which only narrows)
    {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"], "c": {"required": ["a"]}}},
    {"dependentRequired": {"a": ["b", "c"]}, "dependentSchemas": {"b": {"properties": {"a": {"type": "string"}}}}},
    {"oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}]},
    {"type": "object", "oneOf": [{"properties": {"kind": {"const": "circle"}}, "required": ["kind", "r"]},
                                 {"properties": {"kind": {"const": "square"}}, "required": ["kind", "side"]}]},
    {"oneOf": [{"type": "string"}, {"minLength": 2}]},
    {"oneOf": [{"type": "number"}, {"maximum": 2}]},
    {"oneOf": [{"type": "string"}, {"type": "array"}], "anyOf": [{"minLength": 2}, {"minItems": 2}]},
    {"oneOf": [{"required": ["a"]}]},
    {"oneOf": [{"enum": [1, 2]}, {"enum": [2, "x"]}]},
])
def test_rewrites_keep_the_meaning(schema):
    prepared = same_meaning(schema, INSTANCES)
    assert not {"not", "if", "then", "else", "dependencies", "dependentRequired", "dependentSchemas",
                "oneOf"} & set(walk_keys(prepared)), json.dumps(prepared)


def test_what_cannot_be_rewritten_is_left_for_the_engine_to_refuse():
    for schema in ({"not": {"pattern": "^a"}}, {"not": {"type": "integer"}},
                   {"oneOf": [{"type": "integer"}, {"type": "number"}]},
                   {"if": {"items": {"type": "string"}}, "then": {"minItems": 1}}):
        out = same_meaning(schema, INSTANCES)
        assert {"not", "oneOf", "if"} & out.keys()


def test_without_rewrites_only_annotations_formats_and_drafts_change():
    schema = {"title": "t", "type": "object", "not": {"required": ["a"]}, "oneOf": [{"required": ["b"]}],
              "properties": {"p": {"format": "path", "type": "string", "description": "d"}}}
    assert prepare_schema(schema, rewrite=False) == {"type": "object", "not": {"required": ["a"]},
                                                     "oneOf": [{"required": ["b"]}],
                                                     "properties": {"p": {"type": "string"}}}


def test_not_words_regex_matches_exactly_the_other_strings():
    rng = random.Random(0)
    for _ in range(50):
        words = list({"".join(rng.choice("ab.\\]") for _ in range(rng.randint(0, 3))) for _ in range(4)})
        rx = re.compile("^(?:" + _not_words(words) + ")$", re.S)
        for _ in range(100):
            s = "".join(rng.choice("ab.\\]\n") for _ in range(rng.randint(0, 4)))
            assert bool(rx.match(s)) == (s not in words), (words, s)


def test_non_schemas_are_refused():
    with pytest.raises(GrammarError):
        prepare_schema([{"type": "string"}])
    assert prepare_schema(True) is True


@pytest.fixture(scope="module")
def backend():
    from braid.runtime.constrained.grammar import GrammarBackend
    from braid.runtime.loader.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    b = GrammarBackend(tok, len(tok), engine="llguidance", json_strict=False)
    yield tok, b
    b.shutdown()


def accepts(tok, grammar, value) -> bool:
    state = grammar.new_state()
    for t in tok.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False):
        try:
            state.accept_token(t)
        except GrammarError:
            return False
    return state.is_accepting()


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
     "dependencies": {"a": ["b"]}, "title": "x", "x-order": 1},
    {"type": "object", "properties": {"kind": {"type": "string"}, "r": {"type": "number"}},
     "if": {"properties": {"kind": {"const": "circle"}}}, "then": {"required": ["r"]}},
    {"type": "object", "properties": {"radius": {"type": "number"}, "length": {"type": "number"},
                                      "width": {"type": "number"}},
     "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}]},
    {"type": "object", "properties": {"a": {"not": {"enum": ["x", 1]}}}},
])
def test_the_llguidance_engine_compiles_the_rewrites_and_judges_like_jsonschema(backend, schema):
    tok, b = backend
    grammar = b.compile("json", json.dumps(schema))
    check = jsonschema.Draft202012Validator(schema)
    objects = [x for x in INSTANCES if isinstance(x, dict)] + [{"kind": "circle", "r": 1}, {"kind": "square"}]
    for x in objects:
        if check.is_valid(x) or not accepts(tok, grammar, x):
            continue
        pytest.fail(f"invalid instance {x} accepted by {schema}")
    assert accepts(tok, grammar, {"a": 1, "b": 2}) == check.is_valid({"a": 1, "b": 2})


def test_the_engine_refuses_what_is_left_by_name(backend):
    _, b = backend
    with pytest.raises(GrammarError, match="uniqueItems"):
        b.compile("json", json.dumps({"type": "array", "uniqueItems": True}))
