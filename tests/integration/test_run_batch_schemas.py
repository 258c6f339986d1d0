"""braid's main job at batch: `run_batch` of 64 JSON-extraction programs, each with its own schema, on a real server
(braid.Runtime on SmolLM2). Every program completes, and every output validates under its schema at temperature 1."""

from __future__ import annotations

import json
import random

import jsonschema

import braid

FIELDS = ("name", "city", "country", "title", "author", "year", "price", "rating", "owner", "status", "color", "size",
          "code", "level", "team", "genre")
WORDS = ("red", "blue", "green", "north", "south", "open", "closed", "small", "large", "new")


def schema_for(i: int) -> dict:
    """A distinct small schema: 2-4 bounded properties (strings with maxLength, ranged integers, enums, booleans)."""
    rng = random.Random(i)
    props = {}
    for name in rng.sample(FIELDS, rng.randint(2, 4)):
        kind = rng.choice(("string", "integer", "enum", "boolean"))
        if kind == "string":
            props[name] = {"type": "string", "maxLength": rng.choice((6, 10, 14))}
        elif kind == "integer":
            props[name] = {"type": "integer", "minimum": 0, "maximum": rng.choice((99, 2100))}
        elif kind == "enum":
            props[name] = {"enum": rng.sample(WORDS, 3)}
        else:
            props[name] = {"type": "boolean"}
    return {"type": "object", "properties": props, "required": list(props)}


@braid.function
def extract(s, doc, schema):
    s += braid.system("Extract the record described in the text as JSON.")
    s += braid.user(doc)
    s += braid.assistant(braid.gen("record", max_tokens=96, json_schema=schema))


def test_run_batch_of_64_programs_each_with_its_own_schema(runtime):
    schemas = [schema_for(i) for i in range(64)]
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 64
    docs = [f"Item {i}: a {WORDS[i % len(WORDS)]} thing made in {1990 + i} by team {i % 7}." for i in range(64)]
    states = extract.run_batch([{"doc": d, "schema": s} for d, s in zip(docs, schemas)], backend=runtime,
                               num_threads=64, progress_bar=False, temperature=1.0)
    failures = [s for s in states if not isinstance(s, braid.ProgramState)]
    assert not failures, failures[:3]
    for state, schema in zip(states, schemas):
        jsonschema.validate(json.loads(state["record"]), schema)
