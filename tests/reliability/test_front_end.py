"""The HTTP front end under big prompts, bad numbers, deep JSON and too many requests: 4xx, never 5xx, and
/health answers while a big prompt tokenizes."""

import http.client
import json
import random
import threading
import time

import pytest
import requests
from reliability_servers import GRAMMAR_TIMEOUT_S, MAX_BODY_BYTES, MAX_PROMPT_CHARS, MAX_QUEUED, MAX_RUNNING

from braid.runtime.config import ServerArgs
from braid.runtime.server.http_middleware import resolve_api_key


def _error(resp: requests.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _words(num_chars: int) -> str:
    rng = random.Random(0)
    vocab = ["alpha", "beta", "gamma", "delta", "braid", "tokens", "queue", "health", "the", "of"]
    words, size = [], 0
    while size < num_chars:
        w = rng.choice(vocab)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:num_chars]


def test_api_key_comes_from_the_environment_not_the_command_line(front_server):
    with open(f"/proc/{front_server.proc.pid}/cmdline", "rb") as f:
        assert front_server.api_key.encode() not in f.read()
    assert _error(front_server.get("/get_model_info", headers={}), 401)["code"] == "invalid_api_key"
    assert front_server.get("/get_model_info").status_code == 200
    info = front_server.get("/get_server_info").json()
    assert info["api_key"] is None and info["api_key_set"] is True
    assert info["max_prompt_chars"] == MAX_PROMPT_CHARS and info["max_queued_requests"] == MAX_QUEUED


def test_api_key_file(tmp_path, monkeypatch):
    monkeypatch.delenv("BRAID_API_KEY", raising=False)
    path = tmp_path / "key"
    path.write_text("from-file\nignored\n")
    assert resolve_api_key(ServerArgs(api_key_file=str(path))) == "from-file"
    monkeypatch.setenv("BRAID_API_KEY", "from-env")
    assert resolve_api_key(ServerArgs()) == "from-env"
    assert resolve_api_key(ServerArgs(api_key="flag")) == "flag"
    with pytest.raises(ValueError):
        ServerArgs(api_key="a", api_key_file=str(path))


def test_prompt_over_the_limit_is_a_400_naming_the_limit(front_server):
    text = "a" * (MAX_PROMPT_CHARS + 1)
    for path, body, param in (
            ("/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}}, "text"),
            ("/generate", {"text": ["hi", text], "sampling_params": {"max_new_tokens": 1}}, "text"),
            ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text[:MAX_PROMPT_CHARS // 2]},
                                                   {"role": "user", "content": text[:MAX_PROMPT_CHARS // 2 + 1]}],
                                      "max_tokens": 1}, "messages")):
        start = time.perf_counter()
        err = _error(front_server.post(path, body), 400)
        assert time.perf_counter() - start < 2.0  # refused before tokenizing
        assert f"{MAX_PROMPT_CHARS}" in err["message"] and "--max-prompt-chars" in err["message"]
        assert (err["param"], err["code"]) == (param, "prompt_too_long")


def test_body_over_the_limit_is_a_413(front_server):
    err = _error(front_server.post("/generate", {"text": "a" * MAX_BODY_BYTES}), 413)
    assert str(MAX_BODY_BYTES) in err["message"]


def test_health_answers_while_a_big_prompt_tokenizes(front_server):
    text = _words(MAX_PROMPT_CHARS - 10)
    result = {}

    def big():
        start = time.perf_counter()
        result["resp"] = front_server.post("/v1/completions", {"prompt": text, "max_tokens": 1})
        result["seconds"] = time.perf_counter() - start

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)  # the body is sent and tokenizing
    latencies = []
    while t.is_alive():
        start = time.perf_counter()
        assert requests.get(front_server.base_url + "/health", timeout=30).status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)
    t.join()
    # the tokenized prompt is far longer than the context: refused after tokenizing, as a 400
    err = _error(result["resp"], 400)
    assert err["code"] == "context_length_exceeded"
    print(f"big prompt answered in {result['seconds']:.2f}s; /health during it: {len(latencies)} calls, "
          f"max {max(latencies) * 1000:.0f} ms, median {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms")
    assert len(latencies) >= 5 and max(latencies) < 1.0


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"text": "hi", "sampling_params": {"seed": 2**64}}, "seed"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": -(2**63) - 1}}, "seed"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 10**30}}, "top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**30}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [10**30]}}, "stop_token_ids"),
    ("/generate", {"text": "hi", "logprob_start_len": 10**30}, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 10**30]}, "input_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**40}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
])
def test_out_of_range_numbers_and_bad_fields_are_400s(front_server, path, body, param):
    assert _error(front_server.post(path, body), 400)["param"] == param


def test_json_nested_100k_deep_is_a_400(front_server):
    for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
        body = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        resp = requests.post(front_server.base_url + path, data=body, timeout=60,
                             headers={**front_server.headers, "Content-Type": "application/json"})
        assert "nested too deeply" in _error(resp, 400)["message"]


def test_response_format_on_completions_constrains_the_output(front_server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    resp = front_server.post("/v1/completions", {
        "prompt": "Answer in JSON:", "max_tokens": 16, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert resp.status_code == 200, resp.text
    assert json.loads(resp.json()["choices"][0]["text"])["answer"] in ("yes", "no")


def test_beyond_max_queued_requests_is_a_429_with_retry_after(front_server):
    body = {"text": "Count to one thousand: 1, 2, 3,", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
    streams = []

    def open_stream():
        r = requests.post(front_server.base_url + "/generate", json=body, headers=front_server.headers,
                          stream=True, timeout=300)
        streams.append(r)

    # a queued stream gets its headers with its first token: the clients wait on threads
    threads = [threading.Thread(target=open_stream, daemon=True) for _ in range(MAX_RUNNING + MAX_QUEUED)]
    try:
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while front_server.get("/get_server_info").json()["num_server_requests"] < MAX_RUNNING + MAX_QUEUED:
            assert time.time() < deadline
            time.sleep(0.1)
        for path, extra in (("/generate", {"text": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/completions", {"prompt": "hi"})):
            resp = front_server.post(path, {**extra, "max_tokens": 1} if path != "/generate" else extra)
            err = _error(resp, 429)
            assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
            assert int(resp.headers["Retry-After"]) >= 1
        assert requests.get(front_server.base_url + "/health", timeout=10).status_code == 200
    finally:
        deadline = time.time() + 120
        while any(t.is_alive() for t in threads) and time.time() < deadline:
            for r in list(streams):  # a closed stream frees the slot a queued one waits for
                r.close()
            time.sleep(0.2)
        for r in streams:
            r.close()
    stats = front_server.idle_stats()
    assert stats["num_server_requests"] == 0 and stats["kv_used_tokens"] == 0
    ok = front_server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200, ok.text


def _post_from(server, source_ip: str, path: str, body: dict) -> tuple[int, dict, dict]:
    """POST from a given loopback source address (another client to the server): status, headers, JSON body."""
    host, port = server.base_url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120, source_address=(source_ip, 0))
    try:
        conn.request("POST", path, body=json.dumps(body), headers={**server.headers, "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def test_grammar_compiles_are_capped_per_client(front_server):
    """outlines-core on one compile worker: 2 compiles at once, 1 of a client's; --grammar-max-queued-per-client 1.
    While a client's pathological regex compiles, its second new one waits and its third is a 429 at once; another
    client's regex starts beside them and is served at once."""
    slow = ["(a|b)*a(a|b){24}", "(a|b)*b(a|b){25}", "(a|b)*a(a|b){23}"]

    def regex_body(regex: str) -> dict:
        return {"text": "Say maybe:", "sampling_params": {"max_new_tokens": 4, "regex": regex, "temperature": 0}}

    results = {}

    def post(name: str, regex: str) -> None:
        results[name] = _post_from(front_server, "127.0.0.1", "/generate", regex_body(regex))

    threads = [threading.Thread(target=post, args=(f"slow{i}", regex)) for i, regex in enumerate(slow[:2])]
    for t in threads:
        t.start()
        time.sleep(0.5)  # in this order: the first compiling, the second waiting for the client's turn
    started = time.time()
    status, headers, body = _post_from(front_server, "127.0.0.1", "/generate", regex_body(slow[2]))
    assert status == 429, body
    assert time.time() - started < 2, "the capped request must fail at once, not after a compile"
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["param"] == "regex", body
    assert "--grammar-max-queued-per-client" in body["error"]["message"] and int(headers["Retry-After"]) >= 1
    started = time.time()
    status, _, body = _post_from(front_server, "127.0.0.2", "/generate", regex_body("(maybe|perhaps)"))
    assert status == 200, body
    assert body["text"] in ("maybe", "perhaps") and time.time() - started < GRAMMAR_TIMEOUT_S
    for t in threads:
        t.join(timeout=GRAMMAR_TIMEOUT_S * 10)
    for name in ("slow0", "slow1"):  # each ends with the compile timeout: a 400 naming the regex
        status, _, body = results[name]
        assert status == 400 and body["error"]["param"] == "regex", (name, body)
    stats = front_server.idle_stats()
    assert stats["num_server_requests"] == 0 and stats["kv_used_tokens"] == 0
