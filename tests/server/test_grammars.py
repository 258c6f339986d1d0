"""Context-free grammars and structural tags on the real SmolLM2 server, through every surface that carries one:
/generate's `ebnf` (Lark and GBNF text) and `structural_tag`, vLLM's `guided_grammar` and `structured_outputs`,
`response_format` (json_object, structural_tag), and the DSL's gen(grammar=...) on RuntimeEndpoint and on the OpenAI
backend. 100 samples at temperature 1.0 in all from recursive grammars, each checked with the `lark` package against
the same grammar; then the 400s: two grammar sources in one request, and grammars the engine rejects."""

import json

import jsonschema
import lark
import openai
import pytest
from server_helpers import API_KEY

import braid
from braid.runtime.server.errors import APIError
from braid.runtime.server.openai_constraints import GrammarServing
from braid.runtime.server.openai_protocol import ChatCompletionRequest, openai_sampling_overrides, parse_openai

# recursive: parenthesised sub-expressions
ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
# the same language in GBNF (`root ::= ...`), checked with ARITH
ARITH_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9] [0-9]? [0-9]?
"""
# recursive: lists nest in lists
LISTS = r"""
start: list
list: "[" [item ("," item)*] "]"
item: NUMBER | list
NUMBER: /[0-9]{1,3}/
"""
ARITH_ASK = [{"role": "user", "content": "Write an arithmetic expression with parentheses, like (1+2)*3."}]
LISTS_ASK = [{"role": "user", "content": "Write a nested list of numbers, like [1,[2,3]]."}]
MALFORMED = 'start: "(" expr\n'  # expr is never defined


def assert_in_language(grammar: str, outputs: list[tuple[str, str]]) -> None:
    """Every output the model ended is a sentence of `grammar`; one cut at max_tokens is a prefix of one. Most
    must have ended (a grammar that never lets the model stop would pass the prefix check alone)."""
    parser = lark.Lark(grammar, parser="lalr")
    for text, finish in outputs:
        try:
            if finish == "stop":
                parser.parse(text)
            else:
                assert finish == "length", finish
                parser.parse_interactive(text).exhaust_lexer()
        except lark.exceptions.LarkError as e:
            pytest.fail(f"{text!r} ({finish}) is not in the grammar: {e}")
    ended = sum(finish == "stop" for _, finish in outputs)
    assert ended >= 0.7 * len(outputs), outputs


def chat_ids(server, messages) -> list[int]:
    return server.post("/tokenize", {"messages": messages}).json()["tokens"]


def native(server, sampling_params: dict, prompt_ids: list[int]) -> list[dict]:
    r = server.post("/generate", {"input_ids": prompt_ids, "sampling_params": sampling_params})
    assert r.status_code == 200, r.text
    out = r.json()
    return out if isinstance(out, list) else [out]


def bad_request(fn) -> dict:
    with pytest.raises(openai.BadRequestError) as ei:
        fn()
    return ei.value.body if isinstance(ei.value.body, dict) and "param" in ei.value.body else ei.value.body["error"]


def still_serves(openai_client):
    r = openai_client.chat.completions.create(model="default", messages=ARITH_ASK, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- samples through each surface (100 in all) ------------------------------------------------------------------


@pytest.mark.parametrize("grammar, n", [(ARITH, 20), (ARITH_GBNF, 10)], ids=["lark", "gbnf"])
def test_native_ebnf(server, grammar, n):
    outs = native(server, {"ebnf": grammar, "n": n, "temperature": 1.0, "max_new_tokens": 48, "seed": 11},
                  chat_ids(server, ARITH_ASK))
    assert len(outs) == n
    assert_in_language(ARITH, [(o["text"], o["meta_info"]["finish_reason"]["type"]) for o in outs])


def test_openai_guided_grammar(openai_client):
    r = openai_client.chat.completions.create(model="default", messages=LISTS_ASK, max_tokens=48, temperature=1.0,
                                              n=20, seed=12, extra_body={"guided_grammar": LISTS})
    assert_in_language(LISTS, [(c.message.content, c.finish_reason) for c in r.choices])
    assert any(c.message.content.count("[") > 1 for c in r.choices)  # the recursion was taken


def test_structured_outputs_grammar_on_completions(server, openai_client):
    r = openai_client.completions.create(model="default", prompt=chat_ids(server, ARITH_ASK), max_tokens=48,
                                         temperature=1.0, n=15, seed=13,
                                         extra_body={"structured_outputs": {"grammar": ARITH},
                                                     "guided_decoding_backend": "llguidance"})
    assert_in_language(ARITH, [(c.text, c.finish_reason) for c in r.choices])


def test_response_format_json_object(openai_client):
    ask = [{"role": "user", "content": "Describe a cat as a JSON object."}]
    r = openai_client.chat.completions.create(model="default", messages=ask, max_tokens=64, temperature=1.0, n=10,
                                              seed=14, response_format={"type": "json_object"})
    ended = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert len(ended) >= 7, [c.message.content for c in r.choices]
    for text in ended:
        assert isinstance(json.loads(text), dict), text
    for c in r.choices:
        assert c.message.content.startswith("{"), c.message.content


@braid.function
def expression(s):
    s += braid.user(ARITH_ASK[0]["content"])
    s += braid.assistant(braid.gen("expr", max_tokens=48, temperature=1.0, grammar=ARITH))


@braid.function
def nested_list(s):
    s += braid.user(LISTS_ASK[0]["content"])
    s += braid.assistant(braid.gen("lst", max_tokens=48, temperature=1.0, grammar=LISTS))


def test_dsl_grammar_on_runtime_endpoint(server):
    backend = braid.RuntimeEndpoint(server.base_url, api_key=API_KEY)
    states = expression.run_batch([{}] * 15, backend=backend, progress_bar=False, num_threads=15)
    assert_in_language(ARITH, [(s["expr"], s.get_meta_info("expr")["finish_reason"]["type"]) for s in states])


def test_dsl_grammar_on_the_openai_backend(server):
    backend = braid.OpenAI("default", base_url=server.base_url + "/v1", api_key=API_KEY)
    states = nested_list.run_batch([{}] * 10, backend=backend, progress_bar=False, num_threads=10)
    assert_in_language(LISTS, [(s["lst"], s.get_meta_info("lst")["finish_reason"]["type"]) for s in states])


# ---- structural tags ------------------------------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
WEATHER_TAG = {"type": "structural_tag", "structures": [{"begin": "<weather>", "schema": CITY, "end": "</weather>"}],
               "triggers": ["<weather>"]}
FEW_SHOT = ('Q: What is the weather in Rome?\nA: <weather>{"city":"Rome"}</weather>\n'
            'Q: What is the weather in Oslo?\nA: <weather>{"city":"Oslo"}</weather>\n'
            "Q: What is the weather in Paris?\nA:")


def assert_tags_follow_schema(texts: list[str]) -> None:
    """Each <weather> segment the model opened holds a CITY object and is closed (unless the output was cut inside
    it); at least one was opened."""
    opened = 0
    for text in texts:
        segments = text.split("<weather>")[1:]
        for i, segment in enumerate(segments):
            opened += 1
            if "</weather>" in segment:
                jsonschema.validate(json.loads(segment.split("</weather>")[0]), CITY)
                continue
            assert i == len(segments) - 1, text  # only the output's end may cut a segment
            try:
                obj, end = json.JSONDecoder().raw_decode(segment)
            except ValueError:
                continue  # cut inside the object
            jsonschema.validate(obj, CITY)
            assert "</weather>".startswith(segment[end:]), text
    assert opened > 0, texts


def test_structural_tag_on_native_and_response_format(server, openai_client):
    ids = server.post("/tokenize", {"prompt": FEW_SHOT}).json()["tokens"]
    sglang_form = json.dumps({k: WEATHER_TAG[k] for k in ("structures", "triggers")})  # SGLang's JSON text
    outs = native(server, {"structural_tag": sglang_form, "n": 5, "temperature": 1.0, "max_new_tokens": 24,
                           "seed": 15, "stop": ["\nQ:"]}, ids)
    assert_tags_follow_schema([o["text"] for o in outs])
    r = openai_client.completions.create(model="default", prompt=FEW_SHOT, max_tokens=24, temperature=1.0, n=10,
                                         seed=16, stop=["\nQ:"], extra_body={"response_format": WEATHER_TAG})
    assert_tags_follow_schema([c.text for c in r.choices])


# ---- 400s -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route, extra, both", [
    ("chat", {"guided_grammar": LISTS, "guided_json": CITY}, ("guided_grammar", "guided_json")),
    ("chat", {"structured_outputs": {"grammar": LISTS}, "response_format": {"type": "json_object"}},
     ("structured_outputs.grammar", "response_format")),
    ("chat", {"structured_outputs": {"grammar": LISTS, "regex": "a+"}},
     ("structured_outputs.regex", "structured_outputs.grammar")),
    ("completions", {"ebnf": LISTS, "guided_grammar": LISTS}, ("ebnf", "guided_grammar")),
    ("completions", {"guided_regex": "a+", "response_format": WEATHER_TAG}, ("guided_regex", "response_format")),
])
def test_two_grammar_sources_are_a_400_naming_both(openai_client, route, extra, both):
    if route == "chat":
        send = lambda: openai_client.chat.completions.create(model="default", messages=LISTS_ASK, max_tokens=4,
                                                             extra_body=extra)
    else:
        send = lambda: openai_client.completions.create(model="default", prompt="x", max_tokens=4, extra_body=extra)
    err = bad_request(send)
    assert "cannot be combined" in err["message"] and all(p in err["message"] for p in both), err
    assert err["param"] in both
    still_serves(openai_client)


def test_two_grammar_sources_on_native_are_a_400(server, openai_client):
    r = server.post("/generate", {"text": "x", "sampling_params": {"ebnf": LISTS, "regex": "a+"}})
    err = r.json()["error"]
    assert r.status_code == 400 and "regex" in err["message"] and "ebnf" in err["message"], err
    still_serves(openai_client)


@pytest.mark.parametrize("grammar", [MALFORMED, "start: (\n", "root ::= item\n"], ids=["undefined", "syntax", "gbnf"])
def test_a_malformed_grammar_is_a_400_naming_its_parameter(server, openai_client, grammar):
    r = server.post("/generate", {"text": "x", "sampling_params": {"ebnf": grammar, "max_new_tokens": 4}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ebnf", r.text
    err = bad_request(lambda: openai_client.chat.completions.create(
        model="default", messages=LISTS_ASK, max_tokens=4, extra_body={"guided_grammar": grammar}))
    assert err["param"] == "guided_grammar", err
    err = bad_request(lambda: openai_client.completions.create(
        model="default", prompt="x", max_tokens=4, stream=True, extra_body={"structured_outputs": {"grammar": grammar}}))
    assert err["param"] == "structured_outputs.grammar", err
    still_serves(openai_client)


def test_dsl_grammar_the_server_rejects_fails_the_program(server):
    @braid.function
    def broken(s):
        s += braid.user("x")
        s += braid.assistant(braid.gen("out", max_tokens=4, grammar=MALFORMED))

    with pytest.raises(braid.BackendRequestError, match="grammar"):
        broken.run(backend=braid.RuntimeEndpoint(server.base_url, api_key=API_KEY))


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "structural_tag", "triggers": ["<a>"]}}, "response_format.structures"),
    ({"response_format": {**WEATHER_TAG, "structures": [{"begin": "<a>", "schema": CITY}]}},
     "response_format.structures.0.end"),
    ({"response_format": {**WEATHER_TAG, "format": {"type": "const_string", "value": "x"}}}, "response_format.structures"),
    ({"response_format": {"type": "json_object", "triggers": ["<a>"]}}, "response_format.triggers"),
    ({"structured_outputs": {"grammar": LISTS, "bogus": 1}}, "structured_outputs.bogus"),
    ({"structured_outputs": "start: x"}, "structured_outputs"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"guided_grammar": LISTS, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_grammar": LISTS, "guided_decoding_backend": "magic"}, "guided_decoding_backend"),
    ({"guided_grammar": LISTS, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tool_choice"),
])
def test_malformed_grammar_parameters_are_400s(openai_client, extra, param):
    err = bad_request(lambda: openai_client.chat.completions.create(model="default", messages=LISTS_ASK,
                                                                    max_tokens=4, extra_body=extra))
    assert err["param"] == param, err
    still_serves(openai_client)


def test_structured_outputs_json_kinds(openai_client):
    compact = openai_client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a city."}], max_tokens=24, temperature=0,
        extra_body={"structured_outputs": {"json": CITY, "disable_any_whitespace": True}})
    text = compact.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)
    assert " " not in text.split('"city"')[1][:2]
    choice = openai_client.chat.completions.create(
        model="default", messages=LISTS_ASK, max_tokens=8, temperature=1.0, n=4, seed=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "guided_decoding_backend": "xgrammar"})
    assert {c.message.content for c in choice.choices} <= {"yes", "no"}


# ---- what the server's engine decides (no server) -------------------------------------------------------------


@pytest.mark.parametrize("option, serving, refused", [
    ("disable_fallback", GrammarServing(fallback=True), True),
    ("disable_fallback", GrammarServing(fallback=False), False),
    ("disable_additional_properties", GrammarServing(json_strict=False), True),
    ("disable_additional_properties", GrammarServing(json_strict=True), False),
])
def test_structured_outputs_options_the_engine_cannot_honour_are_400s(option, serving, refused):
    body = {"messages": LISTS_ASK, "structured_outputs": {"json": CITY, option: True}}
    req = parse_openai(ChatCompletionRequest, body)
    if not refused:
        assert json.loads(openai_sampling_overrides(req, serving)["json_schema"]) == CITY
        return
    with pytest.raises(APIError) as ei:
        openai_sampling_overrides(req, serving)
    assert ei.value.param == f"structured_outputs.{option}" and ei.value.code == "unsupported_parameter"
    assert json.loads(openai_sampling_overrides(req, GrammarServing())["json_schema"]) == CITY
