"""vLLM's and SGLang's OpenAI-server extensions on one real SmolLM2 server, through the official openai client:
request validation (unknown and unsupported parameters are 400s naming them), guided decoding in both spellings,
logprob options, token-level sampling controls, best_of, and the /tokenize, /detokenize, /version routes.
Each bad input's 400 is followed by a request that shows the server still serves."""

import json
import re

import jsonschema
import openai
import pytest
from real_server import start_server

API_KEY = "compat-key"
FLAGS = ["--max-total-tokens", "4096", "--api-key", API_KEY, "--log-level", "warning"]
MSGS = [{"role": "user", "content": "Give me a number."}]


@pytest.fixture(scope="module")
def server():
    srv = start_server(FLAGS, API_KEY, "braid-vllm-compat-")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, **kw):
    kw.setdefault("max_tokens", 4)
    return client.chat.completions.create(model="default", messages=kw.pop("messages", MSGS), **kw)


def complete(client, **kw):
    kw.setdefault("max_tokens", 4)
    return client.completions.create(model="default", prompt=kw.pop("prompt", "The capital of France is"), **kw)


def bad_request(fn) -> dict:
    with pytest.raises(openai.BadRequestError) as ei:
        fn()
    return ei.value.body if isinstance(ei.value.body, dict) and "param" in ei.value.body else ei.value.body["error"]


def still_serves(client):
    assert chat(client, max_tokens=1, temperature=0).choices[0].finish_reason in ("stop", "length")


# ---- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_unknown_parameter_is_a_400_naming_it(client, route):
    send = chat if route == "chat" else complete
    err = bad_request(lambda: send(client, extra_body={"temprature": 0.5}))
    assert err["param"] == "temprature" and "temprature" in err["message"] and err["code"] == "unknown_parameter"
    err = bad_request(lambda: send(client, stream=True, stream_options={"include_usage": True, "bogus": 1}))
    assert err["param"].startswith("stream_options")
    r = send(client, user="someone", temperature=0)  # `user`: an accepted no-op
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra,param", [
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"echo": True}, "echo"),
])
def test_vllm_only_knobs_are_not_supported(client, extra, param):
    err = bad_request(lambda: chat(client, extra_body=extra))
    assert err["param"] == param and "not supported" in err["message"]
    assert chat(client, max_tokens=1, extra_body={"use_beam_search": False, "length_penalty": 1.0}).choices
    still_serves(client)


def test_stream_options_needs_stream(client):
    err = bad_request(lambda: chat(client, stream_options={"include_usage": True}))
    assert err["param"] == "stream_options"
    err = bad_request(lambda: complete(client, stream=False, stream_options={"include_usage": True}))
    assert err["param"] == "stream_options"
    still_serves(client)


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63, 2**70])
def test_seed_outside_int64_is_a_400(client, seed):
    assert bad_request(lambda: chat(client, seed=seed))["param"] == "seed"
    still_serves(client)


def test_seed_at_the_int64_edges_is_served(client):
    for seed in (-(2**63), 2**63 - 1):
        assert chat(client, seed=seed, max_tokens=2).choices[0].message.content is not None


# ---- guided decoding -------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}, "unit": {"enum": ["years", "months"]}},
          "required": ["name", "age", "unit"], "additionalProperties": False}


@pytest.mark.parametrize("spelling", ["guided_json", "json_schema"])
def test_json_schema_in_both_spellings(client, spelling):
    r = chat(client, max_tokens=40, temperature=1.0, n=3, seed=5,
             extra_body={spelling: SCHEMA, "guided_decoding_backend": "outlines"} if spelling == "guided_json"
             else {spelling: SCHEMA})
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


@pytest.mark.parametrize("spelling", ["guided_regex", "regex"])
def test_regex_in_both_spellings(client, spelling):
    r = complete(client, max_tokens=12, temperature=1.0, n=3, seed=7, extra_body={spelling: r"[0-9]{3}-[0-9]{4}"})
    for c in r.choices:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text), c.text


def test_guided_choice(client):
    choices = ["positive", "negative", "neutral"]
    r = chat(client, max_tokens=8, temperature=1.0, n=4, seed=1, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in r.choices)


def test_guided_whitespace_pattern_is_used(client):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"]}
    r = chat(client, max_tokens=20, temperature=0, extra_body={"guided_json": schema, "guided_whitespace_pattern": "  "})
    text = r.choices[0].message.content
    assert json.loads(text)["a"] in (1, 2, 3) and "  " in text  # the pattern is the only whitespace allowed


@pytest.mark.parametrize("extra,param", [
    ({"guided_json": 42}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_json": SCHEMA}, None),
    ({"regex": "a", "guided_choice": ["x"]}, None),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, None),
    ({"guided_decoding_backend": "magic"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_bad_guided_inputs_are_400s(client, extra, param):
    err = bad_request(lambda: chat(client, extra_body=extra))
    if param is not None:
        assert err["param"] == param, err
    else:
        assert "cannot be combined" in err["message"]
    still_serves(client)


# ---- logprobs --------------------------------------------------------------------------------------------


def test_logprobs_zero_returns_the_sampled_tokens_entry(client):
    r = complete(client, logprobs=0, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(t is not None for t in lp.top_logprobs)
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {tok: tok_lp}
    r = complete(client, logprobs=2, temperature=1.0, seed=3)
    for tok, top in zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.top_logprobs):
        assert tok in top and len(top) in (2, 3)


def _check_prompt_logprobs(entries, prompt_ids, k):
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for tid, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(tid) in entry and k <= len(entry) <= k + 1
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert all(v["logprob"] <= 0 for v in entry.values()) and ranks == list(range(1, k + 1))
        top = max(entry.values(), key=lambda v: v["logprob"])
        assert top["rank"] == 1


def test_prompt_logprobs_on_completions_and_chat(server, client):
    prompt = "The capital of France is"
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    r = complete(client, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2})
    _check_prompt_logprobs(r.model_dump()["choices"][0]["prompt_logprobs"], ids, 2)
    assert r.choices[0].logprobs is None  # only what was asked for
    r = chat(client, max_tokens=1, extra_body={"prompt_logprobs": 1})
    chat_ids = server.post("/tokenize", {"messages": MSGS}).json()["tokens"]
    _check_prompt_logprobs(r.model_dump()["prompt_logprobs"], chat_ids, 1)
    assert bad_request(lambda: complete(client, extra_body={"prompt_logprobs": 21}))["param"] == "prompt_logprobs"
    # the native route gives the same prompt logprobs under SGLang's names
    native = server.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                                       "logprob_start_len": 0}).json()["meta_info"]["input_token_logprobs"]
    completion = complete(client, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    entries = completion.model_dump()["choices"][0]["prompt_logprobs"]
    assert [tid for _, tid in native] == ids and native[0][0] is None
    assert [e[str(tid)]["logprob"] for e, tid in zip(entries[1:], ids[1:])] == pytest.approx(
        [lp for lp, _ in native[1:]], abs=1e-4)


# ---- token-level controls ---------------------------------------------------------------------------------


def test_allowed_token_ids_and_logit_bias(server, client):
    allowed = server.post("/tokenize", {"prompt": " yes no maybe", "add_special_tokens": False}).json()["tokens"]
    r = server.post("/generate", {"text": "Answer:", "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "allowed_token_ids": allowed, "ignore_eos": True}})
    assert r.status_code == 200 and set(r.json()["output_ids"]) <= set(allowed)
    r = complete(client, max_tokens=6, temperature=1.0, seed=2, extra_body={"allowed_token_ids": allowed})
    text = r.choices[0].text
    assert text and set(text.split()) <= {"yes", "no", "maybe"}
    forced = allowed[0]
    r = complete(client, max_tokens=5, temperature=1.0, logit_bias={str(forced): 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [" yes"] * 5
    greedy = complete(client, max_tokens=1, temperature=0, logprobs=0).choices[0].logprobs.tokens[0]
    greedy_id = server.post("/tokenize", {"prompt": greedy, "add_special_tokens": False}).json()["tokens"][0]
    banned = complete(client, max_tokens=1, temperature=0, logprobs=0, logit_bias={str(greedy_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != greedy


@pytest.mark.parametrize("extra,param", [
    ({"logit_bias": {"50000000": 1}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1], "guided_regex": "a"}, "allowed_token_ids"),
])
def test_bad_token_controls_are_400s(client, extra, param):
    assert bad_request(lambda: chat(client, extra_body=extra))["param"] == param
    still_serves(client)


def test_min_tokens_stop_token_ids_and_include_stop_str(server, client):
    r = complete(client, max_tokens=6, temperature=0, extra_body={"min_tokens": 6, "stop_token_ids": [0]})
    assert r.usage.completion_tokens == 6
    base = complete(client, max_tokens=8, temperature=0).choices[0].text
    stop = base.strip().split()[1] if len(base.split()) > 1 else base.strip()[:2]
    cut = complete(client, max_tokens=8, temperature=0, stop=[stop])
    kept = complete(client, max_tokens=8, temperature=0, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert stop not in cut.choices[0].text and kept.choices[0].text == cut.choices[0].text + stop
    first_id = server.post("/tokenize", {"prompt": base, "add_special_tokens": False}).json()["tokens"][0]
    r = complete(client, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [first_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


def test_skip_special_tokens(client):
    shown = complete(client, prompt="<|im_start|>user", max_tokens=3, temperature=0, echo=True,
                     extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False})
    assert shown.choices[0].text.startswith("<|im_start|>user")
    forced = complete(client, max_tokens=2, temperature=1.0, logit_bias={"1": 100}, extra_body={"ignore_eos": True,
                                                                                             "skip_special_tokens": False})
    assert forced.choices[0].text == "<|im_start|>" * 2
    hidden = complete(client, max_tokens=2, temperature=1.0, logit_bias={"1": 100}, extra_body={"ignore_eos": True})
    assert hidden.choices[0].text == ""


# ---- n / best_of ----------------------------------------------------------------------------------------


def test_best_of_returns_the_n_best_by_cumulative_logprob(client):
    r = complete(client, max_tokens=5, temperature=1.0, n=2, best_of=5, logprobs=0, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1]
    single = complete(client, max_tokens=5, temperature=1.0, n=5, logprobs=0, seed=11)
    all_sums = sorted((sum(c.logprobs.token_logprobs) for c in single.choices), reverse=True)
    assert sums == pytest.approx(all_sums[:2], abs=1e-3)  # the same seeds sample the same five; the best two kept
    r = chat(client, max_tokens=3, temperature=1.0, n=1, extra_body={"best_of": 3})
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    assert bad_request(lambda: complete(client, n=3, best_of=2))["param"] == "best_of"
    assert bad_request(lambda: complete(client, n=1, best_of=2, stream=True))["param"] == "best_of"
    still_serves(client)


# ---- streaming usage ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_puts_usage_in_every_chunk(client, route):
    send = chat if route == "chat" else complete
    chunks = list(send(client, max_tokens=5, temperature=0, stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert len(chunks) >= 3 and all(c.usage is not None for c in chunks)
    completions = [c.usage.completion_tokens for c in chunks]
    assert completions == sorted(completions) and completions[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
    plain = list(send(client, max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3
    alone = list(send(client, max_tokens=3, temperature=0, stream=True,
                      stream_options={"continuous_usage_stats": True}))  # vLLM: only together with include_usage
    assert alone and all(c.usage is None for c in alone)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streamed_prompt_logprobs_come_with_the_first_chunk(client, route):
    send = chat if route == "chat" else complete
    chunks = [c.model_dump() for c in send(client, max_tokens=2, temperature=0, stream=True,
                                           extra_body={"prompt_logprobs": 1})]
    first = chunks[0] if route == "chat" else chunks[0]["choices"][0]
    assert first["prompt_logprobs"][0] is None and len(first["prompt_logprobs"]) > 3
    later = [c for c in chunks[1:] if "prompt_logprobs" in c or any("prompt_logprobs" in ch for ch in c["choices"])]
    assert later == []


def test_continue_final_message_continues_the_assistant_turn(client):
    from braid.runtime.config import ServerArgs
    from braid.runtime.loader.tokenizer import get_tokenizer

    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    r = chat(client, messages=messages, max_tokens=5, temperature=0,
             extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = get_tokenizer(ServerArgs()).apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                           continue_final_message=True)
    assert text.endswith("My favourite color is")
    same = complete(client, prompt=text, max_tokens=5, temperature=0, extra_body={"add_special_tokens": False})
    assert r.choices[0].message.content == same.choices[0].text and r.usage.prompt_tokens == same.usage.prompt_tokens
    for extra in ({"continue_final_message": True}, {"chat_template_kwargs": {"tools": []}}):
        assert bad_request(lambda: chat(client, messages=messages, extra_body=extra))["param"] in (
            "continue_final_message", "chat_template_kwargs")
    still_serves(client)


def test_chat_template_kwargs_reach_the_template():
    import asyncio

    from braid.runtime.config import ServerArgs
    from braid.runtime.loader.tokenizer import get_tokenizer
    from braid.runtime.server.openai_protocol import ChatCompletionRequest, chat_template_options, parse_openai
    from braid.runtime.chat_format import with_chat_template
    from braid.runtime.server.tokenizer_manager import TokenizerManager

    tm = TokenizerManager(ServerArgs())
    tm.tokenizer = with_chat_template(get_tokenizer(ServerArgs()),
                                      "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    req = parse_openai(ChatCompletionRequest, {"messages": MSGS, "chat_template_kwargs": {"shout": True}})
    text = asyncio.run(tm.apply_chat_template([{"role": "user", "content": "hi"}], **chat_template_options(req)))
    assert text == "LOUD hi"


# ---- routes ---------------------------------------------------------------------------------------------------


def test_tokenize_detokenize_version(server):
    r = server.post("/tokenize", {"model": "default", "prompt": "Hello world"})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    assert server.post("/tokenize", {"text": "Hello world"}).json()["tokens"] == body["tokens"]  # SGLang's name
    back = server.post("/detokenize", {"model": "default", "tokens": body["tokens"]}).json()
    assert back["prompt"] == back["text"] == "Hello world"
    chat_ids = server.post("/tokenize", {"messages": MSGS}).json()
    no_gen = server.post("/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    assert chat_ids["count"] > no_gen["count"] and chat_ids["tokens"][:no_gen["count"]] == no_gen["tokens"]
    for path, body, param in [("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                              ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = server.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert server.post("/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    version = server.get("/version").json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version)
    info = server.get("/get_server_info").json()
    assert info["version"] == version and info["max_total_tokens"] == 4096 and "num_running_reqs" in info
    model = server.get("/get_model_info").json()
    assert model["model_path"] == "smollm2" and model["is_generation"] is True and model["tokenizer_path"]
