"""LoRA adapters loaded and unloaded while a real server serves (SGLang's /load_lora_adapter, /unload_lora_adapter and
vLLM's /v1/ routes, the latter through the official openai client), with fewer device slots than adapters: greedy
tokens after a dynamic load equal HF + peft's; three adapters through --max-loaded-loras 2 still do; an unload under
32 concurrent requests lets the adapter's running request finish, refuses new ones, and leaves the KV pool and the
adapter slots clean; bad loads are 400s naming what is wrong; --max-loras-per-batch 1 still completes a concurrent
mix of two adapters correctly."""

import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest
import requests
import torch
from real_server import start_server
from server_helpers import metric_values, wait_idle

from lora_tiny import VOCAB, peft_greedy, write_adapter, write_all, write_misfit, write_third

API_KEY = "lora-dyn-key"
NEW = 8
NAMES = (None, "sql", "router", "tagger")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_dynamic")
    return write_third(root, write_all(root))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 14, 11, 17)]


@pytest.fixture(scope="module")
def refs(paths, prompts):
    """{(prompt index, adapter or None): peft's greedy tokens}, at one thread as the server's scheduler runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        combos = [(i, n) for i in range(len(prompts)) for n in NAMES]
        out = peft_greedy(paths["base"], {n: paths[n] for n in NAMES if n}, [prompts[i] for i, _ in combos],
                          [n for _, n in combos], NEW)
    finally:
        torch.set_num_threads(threads)
    return dict(zip(combos, out))


@pytest.fixture(scope="module")
def srv(paths):
    server = start_server(["--model-path", paths["base"], "--enable-lora", "--max-lora-rank", "8",
                           "--max-loaded-loras", "2", "--max-loras-per-batch", "2", "--max-total-tokens", "2048",
                           "--api-key", API_KEY, "--log-level", "warning"], API_KEY, "braid-lora-dyn-")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _v1_post(client, path: str, body: dict) -> httpx.Response:
    """POST to one of the /v1 LoRA routes through the openai client (a 4xx raises its APIStatusError)."""
    return client.post(path, body=body, cast_to=httpx.Response)


def _generate(srv, ids, adapter, max_new_tokens=NEW, **extra) -> requests.Response:
    body = {"input_ids": ids, "lora_path": adapter,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}, **extra}
    return srv.post("/generate", body)


def _ensure_loaded(srv, paths, *names):
    served = {m["id"] for m in srv.get("/v1/models").json()["data"]}
    for name in names:
        if name not in served:
            r = srv.post("/load_lora_adapter", {"lora_name": name, "lora_path": paths[name]})
            assert r.status_code == 200, r.text


def test_dynamic_load_matches_peft(srv, client, paths, prompts, refs):
    assert srv.get("/v1/models").json()["data"][0]["id"] == "base"
    r = _generate(srv, prompts[0], "sql")
    assert r.status_code == 400 and "unknown LoRA adapter 'sql'" in r.json()["error"]["message"]

    r = srv.post("/load_lora_adapter", {"lora_name": "sql", "lora_path": paths["sql"]})  # SGLang's route
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    resp = _v1_post(client, "/load_lora_adapter", {"lora_name": "router", "lora_path": paths["router"]})  # vLLM's
    assert resp.status_code == 200 and resp.json()["loaded_adapters"] == {"sql": paths["sql"],
                                                                         "router": paths["router"]}
    models = client.models.list().data
    assert [m.id for m in models] == ["base", "sql", "router"]
    info = srv.get("/get_server_info").json()
    assert info["max_loaded_loras"] == 2 and info["max_loras_per_batch"] == 2 and info["max_lora_rank"] == 8
    assert info["lora_registered_adapters"] == ["sql", "router"]

    for i, ids in enumerate(prompts):
        for name in (None, "sql", "router"):
            r = _generate(srv, ids, name)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == refs[(i, name)], (i, name)
    # the OpenAI routes select the loaded adapters by model name, with the same answer
    want = _generate(srv, prompts[1], "router").json()["text"]
    for model in ("router", "base:router"):
        c = client.completions.create(model=model, prompt=prompts[1], max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert c.model == model and c.choices[0].text == want


def test_three_adapters_through_two_slots(srv, paths, prompts, refs):
    """--max-loaded-loras 2 with three adapters served at once, interleaved: each answer is peft's for its adapter."""
    _ensure_loaded(srv, paths, "sql", "router", "tagger")
    before = srv.get("/get_server_info").json()["lora_slot_evictions_total"]
    jobs = [(i, name) for _ in range(2) for i in range(len(prompts)) for name in ("sql", "tagger", "router", None)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda job: _generate(srv, prompts[job[0]], job[1]), jobs))
    for job, r in zip(jobs, answers):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == refs[job], job
    # and one at a time, which pages adapters in and out on every change
    for name in ("tagger", "sql", "router", "tagger"):
        assert _generate(srv, prompts[2], name).json()["output_ids"] == refs[(2, name)], name
    info = wait_idle(srv)
    assert info["lora_num_slots"] == 2 and info["lora_slot_evictions_total"] >= before + 2
    metrics = metric_values(srv.get("/metrics").text)
    assert metrics["braid:lora_slot_evictions_total"] == info["lora_slot_evictions_total"]
    assert metrics["braid:lora_slot_loads_total"] >= metrics["braid:lora_slot_evictions_total"] + 2
    assert metrics["braid:lora_free_slots"] == info["lora_free_slots"]


def test_load_and_unload_under_32_concurrent_requests(srv, client, paths, prompts, refs):
    """An unload lets the adapter's running request finish (no abort), refuses new requests on it at once, and
    answers once it is gone; a load in the middle of the traffic serves at once; 32 concurrent requests all answer
    correctly; at the end no KV slot is used and no slot holds the unloaded adapter."""
    _ensure_loaded(srv, paths, "sql", "router", "tagger")
    long_stream = requests.post(srv.base_url + "/generate", headers=srv.headers, stream=True, timeout=300, json={
        "input_ids": prompts[3], "lora_path": "tagger", "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 480, "ignore_eos": True}})
    assert long_stream.status_code == 200
    lines = long_stream.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")  # it runs

    unload = {}

    def do_unload():
        unload["resp"] = _v1_post(client, "/unload_lora_adapter", {"lora_name": "tagger"})
        unload["at"] = time.time()

    unloader = threading.Thread(target=do_unload)
    unloader.start()
    deadline = time.time() + 30
    while "tagger" in {m.id for m in client.models.list().data}:  # gone from the list at once
        assert time.time() < deadline
        time.sleep(0.02)
    r = _generate(srv, prompts[0], "tagger")
    assert r.status_code == 400 and "unknown LoRA adapter 'tagger'" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tagger", prompt=prompts[0], max_tokens=2)
    assert unloader.is_alive()  # still waiting for the stream's request

    jobs = [(i % len(prompts), ("sql", "router", None, "sql2")[i % 4]) for i in range(32)]

    def run(job):
        i, name = job
        if name == "sql2":
            loaded.wait(60)
        return _generate(srv, prompts[i], name)

    loaded = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        resp = _v1_post(client, "/load_lora_adapter", {"lora_name": "sql2", "lora_path": paths["sql"]})
        assert resp.status_code == 200
        loaded.set()
        answers = [f.result() for f in futures]
    for (i, name), r in zip(jobs, answers):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == refs[(i, "sql" if name == "sql2" else name)], (i, name)

    events = [line for line in lines if line]
    assert events[-1] == b"data: [DONE]"
    final = json.loads(events[-2][len(b"data: "):])
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(final["output_ids"]) == 480  # not aborted by the unload
    unloader.join(60)
    assert not unloader.is_alive() and unload["resp"].status_code == 200
    assert "tagger" not in unload["resp"].json()["loaded_adapters"]

    info = wait_idle(srv)
    assert info["lora_unloading_adapters"] == [] and "tagger" not in info["lora_registered_adapters"]
    assert "tagger" not in info["lora_slots"]
    assert srv.post("/flush_cache").status_code == 200
    info = srv.get("/get_server_info").json()
    assert info["kv_free_tokens"] == info["kv_total_tokens"] and info["kv_used_tokens"] == 0
    # and it can come back
    r = srv.post("/load_lora_adapter", {"lora_name": "tagger", "lora_path": paths["tagger"]})
    assert r.status_code == 200
    assert _generate(srv, prompts[1], "tagger").json()["output_ids"] == refs[(1, "tagger")]


def test_bad_loads_are_400s_and_the_server_keeps_serving(srv, client, paths, tmp_path, prompts, refs):
    _ensure_loaded(srv, paths, "sql")
    misfit = str(tmp_path / "misfit")
    write_misfit(paths["sql"], misfit)
    big = str(tmp_path / "big")
    write_adapter(paths["base"], big, 5, r=16, lora_alpha=16, target_modules=["q_proj"])
    cases = [({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, "no such folder", "lora_path",
              "lora_invalid"),
             ({"lora_name": "x", "lora_path": misfit}, "do not fit the base linear", "lora_path", "lora_invalid"),
             ({"lora_name": "x", "lora_path": big}, "rank 16 exceeds --max-lora-rank 8", "lora_path", "lora_invalid"),
             ({"lora_name": "sql", "lora_path": paths["sql"]}, "'sql' is already loaded", "lora_name", "lora_exists"),
             ({"lora_name": "a:b", "lora_path": paths["sql"]}, "without ':'", "lora_name", "lora_invalid"),
             ({"lora_name": "x"}, "lora_path must be a non-empty string", "lora_path", None),
             ({"lora_name": "x", "lora_path": paths["sql"], "pinned": True}, "unknown parameter 'pinned'", "pinned",
              "unknown_parameter")]
    for body, message, param, code in cases:
        with pytest.raises(openai.BadRequestError) as err:
            _v1_post(client, "/load_lora_adapter", body)
        error = err.value.body
        assert message in error["message"] and error["param"] == param and error["code"] == code, (body, error)
        r = srv.post("/load_lora_adapter", body)  # SGLang's route answers the same
        assert r.status_code == 400 and r.json()["error"]["message"] == error["message"]
    r = srv.post("/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "lora_not_found"
    assert "unknown LoRA adapter 'nope'" in r.json()["error"]["message"]
    # still serving, and nothing half-registered
    assert _generate(srv, prompts[0], "sql").json()["output_ids"] == refs[(0, "sql")]
    assert "x" not in srv.get("/get_server_info").json()["lora_registered_adapters"]


def test_one_adapter_per_batch_completes_a_concurrent_mix(paths, prompts, refs):
    """--max-loras-per-batch 1: requests on two adapters (and the base model) sent together are held back, never
    failed, and all answer peft's tokens."""
    other = start_server(["--model-path", paths["base"], "--lora-paths", f"sql={paths['sql']}",
                          f"router={paths['router']}", "--max-loras-per-batch", "1", "--max-total-tokens", "1024",
                          "--api-key", API_KEY, "--log-level", "warning"], API_KEY, "braid-lora-one-")
    try:
        jobs = [(i, name) for _ in range(3) for i in range(len(prompts)) for name in ("sql", "router", None)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda job: _generate(other, prompts[job[0]], job[1]), jobs))
        for job, r in zip(jobs, answers):
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == refs[job], job
        info = wait_idle(other)
        assert info["max_loras_per_batch"] == 1 and info["max_loaded_loras"] == 1
    finally:
        other.stop()
