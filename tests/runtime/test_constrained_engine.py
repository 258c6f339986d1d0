"""Constrained decoding end to end on SmolLM2: outputs always match, jump-forward saves decode steps."""

import json
import re

import jsonschema
import pytest

from braid.runtime import Engine

N = 128  # samples per pattern at temperature 1, batched together
REGEXES = {
    "date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    "enum": r"(red|green|blue|yellow)",
    "nested": r"((ab|cd)(x[0-9])?){1,3}-(yes|no)",
    "email": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer"}}, "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
                 "required": ["id", "admin"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["user", "tags"]},
    "enum_number": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                     "score": {"type": "number"}}, "required": ["color", "score"]},
    "optional": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 10},
                                                  "year": {"type": "integer"}}, "required": ["title"]},
}
FIXED_KEYS = {"type": "object", "properties": {k: {"type": "boolean"} for k in
              ["alpha_value", "beta_value", "gamma_value", "delta_value", "epsilon_value", "zeta_value"]},
              "required": ["alpha_value", "beta_value", "gamma_value", "delta_value", "epsilon_value", "zeta_value"]}


# engines of their own, before the module's large engine exists (so two are never alive at once)
def test_jump_forward_halves_decode_steps():
    counts = {}
    for disable in (False, True):
        with Engine(model_path="smollm2", log_level="warning", disable_jump_forward=disable,
                    max_total_tokens=4096) as e:
            res = e.generate(["Record: "] * 4, {"temperature": 1.0, "max_new_tokens": 200, "seed": 2,
                                                "json_schema": json.dumps(FIXED_KEYS)})
            for r in res:
                jsonschema.validate(json.loads(r["text"]), FIXED_KEYS)
            stats = e.get_stats()
            counts[disable] = dict(steps=stats["num_forward_decode"] + stats["num_forward_extend"],
                                   sampled=sum(r["meta_info"]["completion_tokens_wo_jump_forward"] for r in res),
                                   tokens=sum(r["meta_info"]["completion_tokens"] for r in res))
    print("jump-forward on:", counts[False], "off:", counts[True])
    assert counts[True]["sampled"] == counts[True]["tokens"]
    assert counts[False]["sampled"] <= 0.5 * counts[True]["sampled"]
    assert counts[False]["steps"] <= 0.5 * counts[True]["steps"]


def test_grammar_timeout_ends_only_that_request():
    # outlines-core: its DFA for this regex blows up (llguidance matches it lazily and never times out)
    with Engine(model_path="smollm2", log_level="warning", grammar_timeout_s=1.0, max_total_tokens=4096,
                grammar_backend="outlines") as e:
        import threading

        results = {}

        def slow():
            try:
                e.generate("x", {"max_new_tokens": 8, "regex": "(a|b)*a(a|b){24}"})
            except ValueError as exc:  # the in-process twin of the server's 400
                results["slow"] = str(exc)

        t = threading.Thread(target=slow)
        t.start()
        fast = e.generate("Count: 1, 2,", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        t.join(timeout=60)
        assert fast["meta_info"]["completion_tokens"] == 6
        assert results["slow"].startswith("grammar error") and "longer than" in results["slow"]
        assert e.get_stats()["kv_used_tokens"] == 0


@pytest.fixture(scope="module")
def engine():
    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=32768, max_running_requests=256) as e:
        yield e
        assert e.get_stats()["kv_used_tokens"] == 0


@pytest.mark.parametrize("name", list(REGEXES))
def test_regex_outputs_always_match(engine, name):
    pattern = REGEXES[name]
    sp = {"temperature": 1.0, "max_new_tokens": 64, "regex": pattern}
    res = engine.generate([f"Give an example ({name}): "] * N, [{**sp, "seed": i} for i in range(N)])
    assert len(res) == N
    for r in res:
        assert re.fullmatch(pattern, r["text"]), (name, r["text"])
        assert r["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_outputs_always_validate(engine, name):
    schema = SCHEMAS[name]
    sp = {"temperature": 1.0, "max_new_tokens": 160, "json_schema": json.dumps(schema)}
    res = engine.generate(["Output a JSON object: "] * N, [{**sp, "seed": i} for i in range(N)])
    assert len(res) == N
    for r in res:
        assert r["meta_info"]["finish_reason"]["type"] == "stop", r["text"]
        jsonschema.validate(json.loads(r["text"]), schema)


def test_bad_grammars_are_rejected(engine):
    for sp in ({"regex": "[.*"}, {"regex": ""}, {"json_schema": "{not json"},
               {"json_schema": json.dumps({"type": "nonsense"})}, {"regex": "a+", "json_schema": "{}"}):
        with pytest.raises(ValueError):
            engine.generate("x", {"max_new_tokens": 4, **sp})
    ok = engine.generate("x", {"max_new_tokens": 3, "regex": "[0-9]{3}", "temperature": 0})
    assert re.fullmatch("[0-9]{3}", ok["text"])


def test_jump_forward_is_on_except_on_cuda_unless_asked():
    import torch

    from braid.runtime.config import ServerArgs
    from braid.runtime.scheduler.output import jump_forward_enabled

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    default = ServerArgs(model_path="smollm2")
    assert jump_forward_enabled(default, cpu) and not jump_forward_enabled(default, cuda)
    enabled, disabled = (ServerArgs(model_path="smollm2", **{k: True}) for k in ("enable_jump_forward",
                                                                                 "disable_jump_forward"))
    assert jump_forward_enabled(enabled, cuda) and jump_forward_enabled(enabled, cpu)
    assert not jump_forward_enabled(disabled, cpu) and not jump_forward_enabled(disabled, cuda)
    with pytest.raises(ValueError, match="contradict"):
        ServerArgs(model_path="smollm2", enable_jump_forward=True, disable_jump_forward=True)
