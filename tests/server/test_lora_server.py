"""A server started with --lora-paths: the official openai client picks adapters by model name ("adapter" and
"base:adapter"), native /generate by lora_path; answers equal the in-process Engine's under the same adapter (which
tests/runtime/test_lora_engine.py holds against peft); unknown adapters get OpenAI error objects."""

import openai
import pytest
import requests
import torch
from real_server import start_server

from lora_tiny import ADAPTERS, write_all

API_KEY = "lora-key"
PROMPT = "The quick brown fox jumps over"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("lora_server"))


@pytest.fixture(scope="module")
def server(paths):
    srv = start_server(["--model-path", paths["base"], "--lora-paths", *(f"{n}={paths[n]}" for n in ADAPTERS),
                        "--max-total-tokens", "4096", "--api-key", API_KEY, "--log-level", "warning"], API_KEY,
                       "braid-lora-")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine_outputs(paths):
    """{adapter or None: greedy output ids of PROMPT} from the in-process Engine."""
    from braid.runtime import Engine

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as the server's scheduler runs (tests/helpers/real_server.py)
        with Engine(model_path=paths["base"], lora_paths=[f"{n}={paths[n]}" for n in ADAPTERS],
                    log_level="warning") as engine:
            return {a: engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
                                       lora_path=a) for a in (None, *ADAPTERS)}
    finally:
        torch.set_num_threads(threads)


def _headers():
    return {"Authorization": f"Bearer {API_KEY}"}


def test_models_and_server_info_list_adapters(server, paths):
    ids = [m["id"] for m in requests.get(server.base_url + "/v1/models", headers=_headers()).json()["data"]]
    assert ids == ["base", *ADAPTERS]
    info = requests.get(server.base_url + "/get_server_info", headers=_headers()).json()
    assert info["enable_lora"] is True and info["max_loras_per_batch"] == 8
    assert info["lora_paths"] == [f"{n}={paths[n]}" for n in ADAPTERS]


def test_openai_model_name_selects_the_adapter(client, engine_outputs):
    got = {}
    for model, adapter in (("base", None), ("sql", "sql"), ("base:router", "router"), ("router", "router")):
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=1, extra_body={"ignore_eos": True})
        assert r.model == model
        assert r.choices[0].text == engine_outputs[adapter]["text"], model
        got[model] = r.choices[0].logprobs.token_logprobs
    # the adapters change the answer, and the two spellings of one adapter agree
    assert got["sql"] != got["base"] and got["router"] != got["base"]
    assert got["router"] == got["base:router"]


def test_streamed_chat_on_an_adapter(client, paths):
    """A streamed chat completion on "base:sql" equals the Engine's greedy answer under sql for the templated
    prompt."""
    from braid.runtime import Engine

    messages = [{"role": "user", "content": "Write a query."}]
    stream = client.chat.completions.create(model="base:sql", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.model == "base:sql" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = "user: Write a query.\nassistant:"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with Engine(model_path=paths["base"], lora_paths=[f"sql={paths['sql']}"], log_level="warning") as engine:
            want = engine.generate(prompt, {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
                                   lora_path="sql")
            base = engine.generate(prompt, {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True})
    finally:
        torch.set_num_threads(threads)
    assert text and text == want["text"] and want["output_ids"] != base["output_ids"]


def test_native_generate_lora_path(server, engine_outputs):
    for adapter in (None, *ADAPTERS):
        body = {"text": PROMPT, "lora_path": adapter,
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
        r = requests.post(server.base_url + "/generate", json=body, headers=_headers())
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == engine_outputs[adapter]["output_ids"], adapter


def test_unknown_adapters_are_openai_errors(client, server):
    for model in ("nope", "base:nope", "other:sql"):
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = requests.post(server.base_url + "/generate", headers=_headers(),
                      json={"text": PROMPT, "lora_path": "nope", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "unknown LoRA adapter 'nope'" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "lora_path"
    # still serving
    r = client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    assert r.usage.completion_tokens == 2
