"""SGLang-compatible language surface: forks[i] +=, state variables written after run(), API speculative
execution (num_api_spec_tokens), token_usage, get_server_args/info, global_config, SGLang's names, dtype regexes,
and the LiteLLM backend's requests (against the fake server; the real server test is in tests/integration)."""

import re

import pytest

import braid
from braid import ir
from braid.backends.base import CAP_FORK, CAP_GEN
from braid.backends.runtime_endpoint import RuntimeEndpoint

from lang_fake_server import FakeServer
from lang_scripted_backend import ScriptedBackend


@pytest.fixture
def fake():
    server = FakeServer().start()
    yield server
    server.stop()


# ---- forks[i] += ... -------------------------------------------------------------------------------
def test_fork_items_append_by_index(backend):
    @braid.function
    def prog(s):
        s += "Start."
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f" branch {i}:" + braid.gen("x", max_tokens=8)
        forks += [f" tail{i}" for i in range(3)]
        forks.join()

    state = prog.run(backend=backend)
    assert len(state["x"]) == 3 and all(isinstance(v, str) for v in state["x"])
    prompts = [c[1].text for c in backend.calls_of("generate")]
    assert sorted(p[-10:] for p in prompts) == [f" branch {i}:" for i in range(3)]
    assert state.text() == "Start."


def test_fork_items_cannot_be_replaced_and_lists_must_fit(backend):
    @braid.function
    def replace(s):
        forks = s.fork(2)
        forks[0] = forks[1]

    with pytest.raises(braid.ProgramError, match=r"forks\[0\] can only be appended to"):
        replace.run(backend=backend)

    @braid.function
    def short_list(s):
        forks = s.fork(2)
        forks += ["only one"]

    with pytest.raises(braid.ProgramError, match="one item per branch"):
        short_list.run(backend=backend)


# ---- variables after run() -------------------------------------------------------------------------
def test_state_variables_writable_after_run(backend):
    @braid.function
    def prog(s):
        s += "Q:" + braid.gen("a", max_tokens=4)

    state = prog.run(backend=backend)
    text = state.text()
    state["b"] = [1, 2]
    state.set_var("a", "overwritten")
    assert state["b"] == [1, 2] and state["a"] == "overwritten" and "b" in state
    assert state.text() == text


# ---- API speculative execution: prompt continuation --------------------------------------------------
@braid.function(num_api_spec_tokens=64)
def profile(s):
    s += "Name:" + braid.gen("name", stop="\n") + "\nAge:" + braid.gen("age", stop="\n") + "\nCity:"
    s += braid.gen("city", max_tokens=32)


def test_speculation_serves_every_gen_from_one_call():
    backend = ScriptedBackend(lambda p, sp: " Ada\nAge: 36\nCity: London")
    state = profile.run(backend=backend)
    assert (state["name"], state["age"], state["city"]) == (" Ada", " 36", " London")
    calls = backend.calls_of("generate")
    assert len(calls) == 1
    sp = calls[0][2][0]
    assert sp.stop in (None, [], ()) and sp.max_new_tokens == 128  # max(64, the gen's default 128)
    assert state.text() == "Name: Ada\nAge: 36\nCity: London"
    assert state.get_meta_info("age")["speculative"] is True


def test_speculation_that_diverges_falls_back_to_normal_calls():
    def reply(prompt, sp):
        return " Ada\nJob: none" if prompt.text.endswith("Name:") else f" v{len(prompt.text)}\nmore"

    backend = ScriptedBackend(reply)
    state = profile.run(backend=backend)
    assert state["name"] == " Ada"
    assert state["age"] == " v14"  # a new call at "Name: Ada\nAge:", cut at its stop
    assert state["city"] == f" v{len(state.text()) - len(state['city'])}\nmore"
    assert len(backend.calls_of("generate")) == 3


def test_waiting_gen_is_settled_when_read_and_takes_a_finished_speculation():
    @braid.function(num_api_spec_tokens=16)
    def prog(s):
        s += "Say:" + braid.gen("a", max_tokens=40)
        s["seen"] = s["a"]  # read before any literal follows
        s += " done" + braid.gen("b", max_tokens=4)

    backend = ScriptedBackend(lambda p, sp: "hello world")
    state = prog.run(backend=backend)
    assert state["a"] == state["seen"] == "hello world"  # the model ended it (EOS) within max_tokens
    assert state["b"] == "hell"  # speculated 11 tokens > its max_tokens 4: its own call
    assert len(backend.calls_of("generate")) == 3


def test_waiting_gen_over_budget_makes_its_normal_call():
    @braid.function(num_api_spec_tokens=16)
    def prog(s):
        s += "Say:" + braid.gen("a", max_tokens=5)

    backend = ScriptedBackend(lambda p, sp: "hello world")
    state = prog.run(backend=backend)
    assert state["a"] == "hello"  # 11 speculated tokens > max_tokens 5: its own call, cut at 5
    assert [c[2][0].max_new_tokens for c in backend.calls_of("generate")] == [16, 5]


def test_constrained_gens_are_not_speculated(backend):
    @braid.function(num_api_spec_tokens=32)
    def prog(s):
        s += "N:" + braid.gen("n", dtype=int) + " W:" + braid.gen("w", max_tokens=6)

    state = prog.run(backend=backend)
    assert isinstance(state["n"], int)
    first = backend.calls_of("generate")[0][2][0]
    assert first.regex == ir.REGEX_INT


def test_speculation_refuses_streaming_and_bad_token_counts(backend):
    with pytest.raises(braid.ProgramError, match="stream=True"):
        profile.run(backend=backend, stream=True)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(braid.ProgramError, match="num_api_spec_tokens"):
            braid.function(lambda s: None, num_api_spec_tokens=bad)


# ---- API speculative execution: chat models ---------------------------------------------------------
@braid.function(num_api_spec_tokens=48)
def chat_profile(s):
    s += braid.user("Who?")
    s += braid.assistant("Name: " + braid.gen("name", stop="\n") + "\nAge: " + braid.gen("age", max_tokens=8))


def _chat_backend(reply):
    def respond(prompt, sp):
        assert prompt.open_role == "assistant" and prompt.open_role_text == ""  # a whole assistant turn
        return reply

    return ScriptedBackend(respond, is_chat_model=True)


def test_chat_speculation_splits_one_reply_at_the_block_text():
    backend = _chat_backend("Name: Ada\nAge: 36 years\nExtra text")
    state = chat_profile.run(backend=backend)
    assert state["name"] == "Ada" and state["age"] == "36 years\nExtra text"
    assert len(backend.calls_of("generate")) == 1
    assert state.messages()[-1] == {"role": "assistant", "content": "Name: Ada\nAge: 36 years\nExtra text"}


def test_chat_speculation_that_never_matches_is_an_error():
    backend = _chat_backend("I do not know.")
    with pytest.raises(braid.ProgramError, match="did not follow the assistant block's text"):
        chat_profile.run(backend=backend)
    assert len(backend.calls_of("generate")) == 3


def test_chat_block_with_one_leading_gen_falls_back_to_its_normal_call():
    @braid.function(num_api_spec_tokens=48)
    def prog(s):
        s += braid.user("Q")
        s += braid.assistant(braid.gen("a", stop=".", max_tokens=20) + ". Done")

    backend = ScriptedBackend(lambda p, sp: "no period here", is_chat_model=True)
    state = prog.run(backend=backend)
    assert state["a"] == "no period here"
    assert state.messages()[-1]["content"] == "no period here. Done"
    assert len(backend.calls_of("generate")) == 2


def test_chat_block_rejects_a_select_after_a_speculative_gen():
    @braid.function(num_api_spec_tokens=16)
    def prog(s):
        s += braid.user("Q")
        s += braid.assistant(braid.gen("a", stop="\n") + braid.select("b", ["x", "y"]))

    with pytest.raises(braid.ProgramError, match="cannot follow a speculative gen"):
        prog.run(backend=ScriptedBackend(is_chat_model=True))


# ---- token_usage, server routes, global_config, names ---------------------------------------------
def test_token_usage_counts_every_call(fake):
    endpoint = RuntimeEndpoint(fake.url)

    @braid.function
    def prog(s):
        s += "Hello" + braid.gen("a", max_tokens=5) + braid.select("b", ["x", "yy"])

    prog.run(backend=endpoint)
    bodies = fake.bodies("/generate")
    assert endpoint.token_usage.completion_tokens == 5  # "fake " ; select scores with 0 new tokens
    assert endpoint.token_usage.prompt_tokens == sum(len(b["text"]) for b in bodies)
    endpoint.token_usage.reset()
    assert (endpoint.token_usage.prompt_tokens, endpoint.token_usage.completion_tokens) == (0, 0)

    chat = braid.OpenAI("m", base_url=fake.url + "/v1", api_key="k")

    @braid.function
    def chat_prog(s):
        s += braid.user("hi")
        s += braid.assistant(braid.gen("a", max_tokens=20))

    chat_prog.run(backend=chat)
    assert (chat.token_usage.prompt_tokens, chat.token_usage.completion_tokens) == (5, len("chat reply"))


def test_server_routes_through_the_language(fake):
    endpoint = RuntimeEndpoint(fake.url)
    assert endpoint.get_server_args()["max_total_tokens"] == 4096
    assert braid.get_server_args(endpoint)["model_path"] == "fake-model"
    assert "num_running_reqs" in braid.get_server_info(endpoint)
    with pytest.raises(braid.ProgramError, match="not a braid runtime"):
        braid.get_server_info(ScriptedBackend())


def test_global_config(backend, capsys):
    cfg = braid.global_config
    cfg.default_backend = backend
    assert braid.get_default_backend() is backend and cfg.default_backend is backend

    @braid.function
    def prog(s):
        s += "Hi" + braid.gen("a", max_tokens=3)

    cfg.verbosity = 2
    try:
        prog.run()
    finally:
        cfg.verbosity = 0
    assert "Hiout" in capsys.readouterr().out
    with pytest.raises(AttributeError, match="not a braid language setting"):
        cfg.default_init_new_token_ratio = 0.5
    with pytest.raises(TypeError):
        cfg.verbosity = "loud"


def test_sglang_names():
    from braid.runtime.engine import Engine

    assert braid.Engine is Engine
    from braid.backends.litellm import LiteLLM

    assert braid.LiteLLM is LiteLLM
    with pytest.raises(AttributeError, match=r"LiteLLM\(\"anthropic/<model>\"\)"):
        braid.Anthropic  # noqa: B018
    for name in ("set_default_backend", "RuntimeEndpoint", "gen", "gen_int", "gen_string", "select", "image",
                 "video", "function", "user_begin", "assistant_end", "flush_cache", "global_config",
                 "get_server_info", "Runtime", "OpenAI", "token_length_normalized"):
        assert hasattr(braid, name), name


def test_sglang_gen_spellings(backend):
    node = braid.gen("n", dtype="int", min_tokens=2)
    assert node.dtype is int and node.sampling["regex"] == ir.REGEX_INT and node.sampling["min_new_tokens"] == 2


@pytest.mark.parametrize("regex, good, bad", [
    (ir.REGEX_INT, ["0", "-42", "123 ", "7\n"], ["", "01", "12  ", "1 2", "1" * 20, "4.5"]),
    (ir.REGEX_FLOAT, ["0", "-1.5", "2e10", "3.25\n"], ["", ".5", "1.", "1.5 x", "1.5\n\n"]),
    (ir.REGEX_BOOL, ["True", "False"], ["true", "True "]),
    (ir.REGEX_STR, ['"a b"', '"x\\"y"'], ['"a', 'a"']),
])
def test_dtype_regexes_end_cleanly(regex, good, bad):
    """A number may end with one space or newline and nothing after it, so a model that does not stop is stopped."""
    for text in good:
        assert re.fullmatch(regex, text), text
    for text in bad:
        assert not re.fullmatch(regex, text), text


# ---- OpenAI / LiteLLM request surfaces ----------------------------------------------------------------
def test_openai_without_base_url_refuses_fields_it_cannot_send():
    backend = braid.OpenAI("gpt-4o-mini", api_key="sk-unused")

    @braid.function
    def prog(s):
        s += braid.user("hi")
        s += braid.assistant(braid.gen("a", top_k=5))

    with pytest.raises(braid.ProgramError, match="takes no top_k"):
        prog.run(backend=backend)


def test_litellm_requests_and_refusals(fake):
    backend = braid.LiteLLM("openai/smollm2", api_base=fake.url + "/v1", api_key="k")
    assert backend.supports(CAP_GEN) and backend.supports(CAP_FORK) and backend.is_chat_model

    @braid.function
    def prog(s, extra):
        s += braid.user("hi")
        s += braid.assistant(braid.gen("a", max_tokens=20, stop="\n", **extra))

    state = prog.run(extra={"seed": 3}, backend=backend, temperature=0.5)
    assert state["a"] == "chat reply"
    body = fake.bodies("/v1/chat/completions")[-1]
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["stop"], body["seed"], body["temperature"]) == (20, ["\n"], 3, 0.5)
    assert backend.token_usage.completion_tokens == len("chat reply")
    with pytest.raises(braid.ProgramError, match="cannot pass top_k"):
        prog.run(extra={"top_k": 5}, backend=backend)

    @braid.function
    def choose(s):
        s += braid.user("hi")
        s += braid.assistant(braid.select("a", ["x", "y"]))

    with pytest.raises(braid.UnsupportedFeatureError, match="select"):
        choose.run(backend=backend)


def test_chat_block_is_generated_when_the_program_reads_it_or_ends_inside_it():
    @braid.function(num_api_spec_tokens=16)
    def reads_inside(s):
        s += braid.user("Q")
        with s.assistant():
            s += braid.gen("a", stop="\n") + "\n" + braid.gen("b")
            s["copy"] = s["a"]

    state = reads_inside.run(backend=_chat_backend("one\ntwo"))
    assert (state["a"], state["b"], state["copy"]) == ("one", "two", "one")
    assert state.messages()[-1]["content"] == "one\ntwo"

    @braid.function(num_api_spec_tokens=16)
    def ends_inside(s):
        s += braid.user("Q")
        s += braid.assistant_begin() + braid.gen("a", stop="\n") + "\n" + braid.gen("b")

    state = ends_inside.run(backend=_chat_backend("one\ntwo"))
    assert (state["a"], state["b"]) == ("one", "two")
    assert state.text().endswith("one\ntwo")


def test_copy_as_a_with_block_joins_back(backend):
    @braid.function
    def prog(s):
        s += "Base."
        with s.copy() as c:
            c += " aside" + braid.gen("x", max_tokens=6)
        s += " after"

    state = prog.run(backend=backend)
    assert state.text() == "Base. after" and isinstance(state["x"], list) and len(state["x"]) == 1

    @braid.function
    def misuse(s):
        with s:
            pass

    with pytest.raises(braid.ProgramError, match="only s.copy"):
        misuse.run(backend=backend)


def test_return_text_in_logprobs_request(fake):
    endpoint = RuntimeEndpoint(fake.url)

    @braid.function
    def prog(s):
        s += "Hi" + braid.gen("a", max_tokens=4, return_logprob=True, return_text_in_logprobs=True)

    prog.run(backend=endpoint)
    assert fake.bodies("/generate")[-1]["return_text_in_logprobs"] is True
    with pytest.raises(braid.ProgramError, match="needs return_logprob"):
        braid.gen("a", return_text_in_logprobs=True)


def test_state_role_methods_take_an_expression_and_programs_cache(backend):
    @braid.function
    def prog(s, question):
        s.system("Be brief. " * 4)
        s.user(question)
        s.assistant(braid.gen("a", max_tokens=5))

    state = prog.run(question="Why?", backend=backend)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[-1]["content"] == state["a"]
    prefix = prog.cache(backend)
    assert prefix and prefix.startswith(backend.get_chat_template().role_prefix("system"))
    assert backend.calls_of("cache_prefix")[-1][1].text == prefix
