"""bench_grammar on a tiny corpus written here (MaskBench's layout; nothing fetched): sample, counts and figures sane,
no engine accepts an invalid instance."""

import json

import pytest

from braid.runtime.bench import bench_grammar as bg

CORPUS = {
    "people---person.json": {
        "schema": {"type": "object", "title": "Person",
                   "properties": {"name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 0}},
                   "required": ["name"], "additionalProperties": False},
        "tests": [{"valid": True, "data": {"age": 3, "name": "Ann"}}, {"valid": True, "data": {"name": "Bo"}},
                  {"valid": False, "data": {"name": ""}}, {"valid": False, "data": {"name": "C", "age": -1}},
                  {"valid": False, "data": {"name": "C", "x": 1}}]},
    "people---tags.json": {
        "schema": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "tests": [{"valid": True, "data": ["a", "b"]}, {"valid": False, "data": ["a", "b", "a"]},
                  {"valid": False, "data": ["c"]}]},
    "shapes---area.json": {
        "schema": {"type": "object", "properties": {"radius": {"type": "number"}, "side": {"type": "number"}},
                   "oneOf": [{"required": ["radius"]}, {"required": ["side"]}], "$comment": "one of the two"},
        "tests": [{"valid": True, "data": {"radius": 1}}, {"valid": True, "data": {"side": 2.5}},
                  {"valid": False, "data": {"radius": 1, "side": 2}}, {"valid": False, "data": {}}]},
    "shapes---flag.json": {
        "schema": {"type": "object", "properties": {"on": {"type": "boolean"}, "level": {"type": "integer"}},
                   "if": {"properties": {"on": {"const": True}}, "required": ["on"]},
                   "then": {"required": ["level"]}},
        "tests": [{"valid": True, "data": {"on": True, "level": 2}}, {"valid": True, "data": {"on": False}},
                  {"valid": False, "data": {"on": True}}]},
    "shapes---unique.json": {  # uniqueItems true: llguidance refuses it, outlines' translation cannot express it
        "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "tests": [{"valid": True, "data": [1, 2]}, {"valid": False, "data": [1, 1]}]},
    "shapes---untested.json": {"schema": {"type": "string"}, "tests": []},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for name, entry in CORPUS.items():
        (root / name).write_text(json.dumps(entry))
    return str(root)


def test_groups_and_stratified_sample(corpus):
    groups = bg.load_corpus(corpus)
    assert {g: len(p) for g, p in groups.items()} == {"people": 2, "shapes": 3}  # the untested schema is skipped
    sample = bg.stratified_sample(groups, 3, seed=0)
    assert len(sample) == 3 and {bg.group_of(p, corpus) for p in sample} == {"people", "shapes"}
    assert sample == bg.stratified_sample(groups, 3, seed=0)
    assert len(bg.stratified_sample(groups, None, seed=0)) == 5


def test_instances_follow_the_schemas_property_order():
    schema = {"properties": {"b": {"$ref": "#/$defs/inner"}, "a": {}}, "$defs": {"inner": {"properties": {"y": {},
                                                                                                          "x": {}}}}}
    text = bg.instance_text({"a": 1, "z": 0, "b": {"x": 1, "y": 2}}, schema, "schema")
    assert text == '{"b":{"y":2,"x":1},"a":1,"z":0}'
    assert bg.instance_text({"a": 1, "b": "é"}, schema, "instance") == '{"a":1,"b":"é"}'


def test_benchmark_on_the_tiny_corpus(corpus, capsys):
    summary = bg.main(["--corpus", corpus, "--limit", "0", "--tokenizers", "smollm2", "--engines", "llguidance",
                       "auto", "outlines", "--no-progress", "--timeout-s", "30"])
    out = capsys.readouterr().out
    assert "python -m braid.bench_grammar --corpus" in out and "commit" in out
    by_engine = {r["engine"]: r for r in summary["results"]}
    assert set(by_engine) == {"llguidance", "auto", "outlines"}
    for r in summary["results"]:
        assert r["schemas"] == 5 and len(r["rows"]) == 5
        assert r["invalid_accepted_schemas"] == 0, r["rows"]
        assert r["mask_disagreements"] == 0
        assert r["right"] == sum(row["right"] for row in r["rows"]) <= r["compiled"]
        assert r["mask_calls"] > 0 and 0 < r["mask_us"]["p50"] <= r["mask_us"]["p99"]
        assert r["compile_ms"]["p50"] <= r["compile_ms"]["p90"] <= r["compile_ms"]["p99"]
        assert r["engine"] in out
    llg = {row["name"]: row for row in by_engine["llguidance"]["rows"]}
    assert by_engine["llguidance"]["right"] == 4 and not llg["shapes---unique.json"]["compiled"]
    assert "uniqueItems" in llg["shapes---unique.json"]["error"]
    assert by_engine["auto"]["right"] >= by_engine["llguidance"]["right"]
