"""gen(grammar=...): a context-free grammar (Lark or EBNF text) from the DSL to each backend's spelling of it —
SamplingParams.ebnf for the runtime's /generate and the in-process engine, vLLM's guided_grammar for OpenAI-compatible
servers — and the programs that cannot use one fail early with a clear error. The runtime's own grammar engine is
exercised end to end in tests/server/test_grammars.py."""

import pytest

import braid
from braid.backends.base import CAP_GEN, CAP_JSON_SCHEMA
from braid.backends.runtime_endpoint import RuntimeEndpoint
from braid.runtime.sampling_params import SamplingParams
from braid.speculation import is_speculable

from lang_fake_server import FakeServer
from lang_scripted_backend import ScriptedBackend

LIST_GRAMMAR = 'start: "[" [NUM ("," NUM)*] "]"\nNUM: /[0-9]+/\n'


@pytest.fixture
def fake():
    server = FakeServer().start()
    yield server
    server.stop()


@braid.function
def numbers(s, grammar):
    s += braid.user("Some numbers, please.")
    s += braid.assistant(braid.gen("nums", max_tokens=20, grammar=grammar))


def test_grammar_reaches_the_backend_as_ebnf(backend):
    numbers.run(grammar=LIST_GRAMMAR, backend=backend)
    sp = backend.calls_of("generate")[0][2][0]
    assert sp.ebnf == LIST_GRAMMAR and sp.regex is None and sp.json_schema is None
    assert sp.grammar() == ("grammar", LIST_GRAMMAR)


def test_grammar_and_ebnf_spellings_are_one_parameter(backend):
    assert braid.gen("x", grammar=LIST_GRAMMAR).sampling["ebnf"] == LIST_GRAMMAR
    assert braid.gen("x", ebnf=LIST_GRAMMAR).sampling["ebnf"] == LIST_GRAMMAR  # SamplingParams' own name
    with pytest.raises(braid.ProgramError, match="same parameter"):
        braid.gen("x", grammar=LIST_GRAMMAR, ebnf=LIST_GRAMMAR)


@pytest.mark.parametrize("kwargs, match", [
    ({"regex": "a"}, "mutually exclusive"),
    ({"json_schema": {"type": "object"}}, "mutually exclusive"),
    ({"dtype": int}, "dtype cannot be combined"),
    ({"grammar_override": ""}, "grammar must be"),
    ({"grammar_override": 5}, "grammar must be"),
])
def test_grammar_argument_errors(kwargs, match):
    grammar = kwargs.pop("grammar_override", LIST_GRAMMAR)
    with pytest.raises(braid.ProgramError, match=match):
        braid.gen("x", grammar=grammar, **kwargs)


def test_a_backend_without_constrained_decoding_refuses_a_grammar():
    plain = ScriptedBackend(capabilities=frozenset({CAP_GEN, CAP_JSON_SCHEMA}))
    with pytest.raises(braid.UnsupportedFeatureError, match="grammar"):
        numbers.run(grammar=LIST_GRAMMAR, backend=plain)
    assert plain.calls_of("generate") == []


def test_a_grammar_gen_is_never_speculated():
    node = braid.gen("x", grammar=LIST_GRAMMAR)
    plain = braid.gen("x")
    assert not is_speculable(node, SamplingParams().merged(**node.sampling), False)
    assert is_speculable(plain, SamplingParams(), False)


def test_runtime_endpoint_sends_ebnf_in_sampling_params(fake):
    numbers.run(grammar=LIST_GRAMMAR, backend=RuntimeEndpoint(fake.url))
    assert fake.bodies("/generate")[-1]["sampling_params"]["ebnf"] == LIST_GRAMMAR


def test_openai_backend_sends_guided_grammar(fake):
    backend = braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k")
    numbers.run(grammar=LIST_GRAMMAR, backend=backend)
    body = fake.bodies("/v1/chat/completions")[-1]
    assert body["guided_grammar"] == LIST_GRAMMAR and "ebnf" not in body


def test_openai_backend_without_extra_body_refuses_a_grammar(fake):
    backend = braid.OpenAI("smollm2", base_url=fake.url + "/v1", api_key="k", constrained="response_format")
    with pytest.raises(braid.UnsupportedFeatureError, match="grammar"):
        numbers.run(grammar=LIST_GRAMMAR, backend=backend)
    assert fake.bodies("/v1/chat/completions") == []
