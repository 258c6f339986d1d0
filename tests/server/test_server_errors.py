"""Each bad input gets its status and an OpenAI error object, and the next request still succeeds."""

import json

import pytest
import requests

from server_helpers import API_KEY, MAX_BODY_BYTES

MSG = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * 9000  # ~9000 tokens, past SmolLM2's 8192


def chat(**kw):
    return {"messages": MSG, "max_tokens": 2, **kw}


CASES = [
    # (name, path, body (dict, or bytes sent raw), headers, status, param)
    ("not json", "/v1/chat/completions", b"{not json", None, 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", None, 400, None),
    ("empty body", "/v1/completions", b"", None, 400, None),
    ("unknown model", "/v1/chat/completions", chat(model="gpt-17"), None, 404, "model"),
    ("no messages", "/v1/chat/completions", {"model": None}, None, 400, "messages"),
    ("prompt over context", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, None, 400, "prompt"),
    ("prompt + max_tokens over context", "/v1/chat/completions", chat(max_tokens=8190), None, 400, "max_tokens"),
    ("max_completion_tokens over context", "/v1/chat/completions", chat(max_completion_tokens=10 ** 6), None, 400,
     "max_completion_tokens"),
    ("temperature", "/v1/chat/completions", chat(temperature=-0.5), None, 400, "temperature"),
    ("top_p", "/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "top_p"),
    ("top_k", "/v1/completions", {"prompt": "x", "top_k": 0}, None, 400, "top_k"),
    ("n too large", "/v1/chat/completions", chat(n=129), None, 400, "n"),
    ("top_logprobs too large", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), None, 400, "top_logprobs"),
    ("logprobs too large", "/v1/completions", {"prompt": "x", "logprobs": 21}, None, 400, "logprobs"),
    ("bad stop", "/v1/chat/completions", chat(stop=5), None, 400, "stop"),
    ("stop token out of vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 7]}, None, 400,
     "stop_token_ids"),
    ("prompt token out of vocab", "/v1/completions", {"prompt": [1, 10 ** 7]}, None, 400, "prompt"),
    ("bad regex", "/v1/completions", {"prompt": "x", "regex": "(unclosed"}, None, 400, "regex"),
    ("bad json schema", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), None, 400, "response_format"),
    ("regex and schema", "/v1/completions", {"prompt": "x", "regex": "a", "json_schema": {"type": "object"}}, None,
     400, "regex"),
    ("body too large", "/v1/completions", json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)}).encode(), None, 413, None),
    ("no api key", "/v1/models", None, {}, 401, None),
    ("wrong api key", "/v1/chat/completions", chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("unknown route", "/v2/nothing", {}, None, 404, None),
    ("native unknown field", "/generate", {"text": "x", "bogus": 1}, None, 400, "bogus"),
    ("native bad sampling param", "/generate", {"text": "x", "sampling_params": {"min_p": 2}}, None, 400, "min_p"),
    ("native over context", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10 ** 6}}, None, 400,
     "max_new_tokens"),
    ("native logprob_start_len", "/generate", {"text": "x", "return_logprob": True, "logprob_start_len": 50}, None,
     400, "logprob_start_len"),
    ("abort without rid", "/abort_request", {}, None, 400, "rid"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_then_good_request(server, name, path, body, headers, status, param):
    hdrs = server.headers if headers is None else headers
    method = requests.get if body is None else requests.post
    kw = {"data": body, "headers": {**hdrs, "Content-Type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body, "headers": hdrs}
    r = method(server.base_url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if status == 401:
        assert err["type"] == "authentication_error"
    ok = server.post("/v1/chat/completions", json=chat(max_tokens=1, temperature=0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 1


def test_streaming_request_is_rejected_before_the_stream_starts(server):
    r = server.post("/v1/chat/completions", json=chat(stream=True, regex="(unclosed"), stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex"
    r = server.post("/generate", json={"text": "x", "stream": True, "sampling_params": {"temperature": -1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_health_needs_no_key_but_everything_else_does(server):
    assert requests.get(server.base_url + "/health", timeout=10).status_code == 200
    for path in ("/get_model_info", "/get_server_info", "/health_generate", "/metrics", "/v1/models"):
        assert requests.get(server.base_url + path, timeout=10).status_code == 401, path
    assert requests.get(server.base_url + "/v1/models", timeout=10,
                        headers={"Authorization": f"Bearer {API_KEY}x"}).status_code == 401
