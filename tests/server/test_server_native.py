"""The native API on a real server: /generate (stream and not), logprobs, stop strings, abort, info routes."""

import threading
import time

import requests

from server_helpers import metric_values, sse_events

PROMPT = "The three primary colors are"
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def generate(server, **body):
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, **body):
    return sse_events(server.post("/generate", json={**body, "stream": True}, stream=True))


def test_health_is_public_and_model_info(server):
    assert requests.get(server.base_url + "/health", timeout=10).status_code == 200
    info = server.get("/get_model_info").json()
    assert info["vocab_size"] == 49152 and info["context_length"] >= 2048
    assert "<|im_start|>" in info["chat_template"] and info["model_path"] == "smollm2"


def test_stream_equals_non_stream(server):
    full = generate(server, text=PROMPT, sampling_params=GREEDY)
    events = stream(server, text=PROMPT, sampling_params=GREEDY)
    assert len(events) >= 2
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == full["text"] and events[-1]["output_ids"] == full["output_ids"]
    assert [e["meta_info"]["finish_reason"] is not None for e in events] == [False] * (len(events) - 1) + [True]
    meta = full["meta_info"]
    assert meta["completion_tokens"] == len(full["output_ids"]) <= 8
    assert meta["finish_reason"]["type"] in ("length", "stop") and meta["prompt_tokens"] == 5


def test_batch_input_ids_and_n(server):
    ids = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()  # warm the cache too
    assert ids["usage"]["prompt_tokens"] == 5
    one = generate(server, text=PROMPT, sampling_params=GREEDY)
    by_ids = generate(server, input_ids=[28120, 905], sampling_params=GREEDY)
    batch = generate(server, text=[PROMPT, "hello world"], sampling_params=GREEDY)
    assert isinstance(batch, list) and len(batch) == 2 and batch[0]["text"] == one["text"]
    assert batch[1]["text"] == by_ids["text"]  # "hello world" is [28120, 905]
    many = generate(server, text=[PROMPT, "hello world"],
                    sampling_params={"n": 2, "temperature": 1.0, "max_new_tokens": 4, "seed": 5})
    assert len(many) == 4 and all(r["meta_info"]["completion_tokens"] <= 4 for r in many)
    assert len({r["meta_info"]["id"] for r in many}) == 2


def test_logprobs(server):
    out = generate(server, text=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 5}, return_logprob=True,
                   logprob_start_len=0, top_logprobs_num=3, return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] and meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(out["output_ids"])
    for (lp, tid, text), tops in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert lp <= 0 and len(tops) == 3 and tops[0][1] == tid and isinstance(text, str)  # greedy picks the top-1
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]


def test_zero_token_prefill_scores_the_prompt(server):
    out = generate(server, text=PROMPT, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=2)
    meta = out["meta_info"]
    assert out["text"] == "" and out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 2
    assert all(lp is not None and lp <= 0 for lp, _ in meta["input_token_logprobs"])
    assert meta["output_token_logprobs"] == []


def test_stop_string_across_tokens_is_never_streamed(server):
    text = generate(server, text=PROMPT, sampling_params=GREEDY)["text"]
    # a stop string that starts inside the first token and ends in a later one
    first_token_text = stream(server, text=PROMPT, sampling_params=GREEDY)[0]["text"]
    cut = len(first_token_text) - 1
    stop = text[cut:cut + 4]
    assert cut >= 1 and len(stop) == 4 and stop.strip() and text.find(stop) == cut
    events = stream(server, text=PROMPT, sampling_params={**GREEDY, "stop": [stop]})
    expected = text[: text.find(stop)]
    assert all(stop not in e["text"] for e in events)
    assert all(expected.startswith(e["text"]) for e in events)
    assert events[-1]["text"] == expected
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = generate(server, text=PROMPT, sampling_params={**GREEDY, "stop": stop, "no_stop_trim": True})
    assert kept["text"] == expected + stop


def test_abort_request_ends_a_running_stream(server):
    events, errors = [], []

    def run():
        try:
            r = server.post("/generate", json={"text": PROMPT, "rid": "abort-me", "stream": True,
                                               "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}},
                            stream=True)
            events.extend(sse_events(r))
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 60
    while time.time() < deadline:
        r = server.post("/abort_request", json={"rid": "abort-me"})
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    t.join(60)
    assert not errors and events
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 2000
    assert server.post("/abort_request", json={"rid": "no-such-request"}).status_code == 404


def test_health_generate_flush_and_server_info(server):
    r = server.get("/health_generate")
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 1
    assert server.post("/flush_cache").json()["success"] is True
    info = server.get("/get_server_info").json()
    assert info["model_path"] == "smollm2" and info["api_key"] == "<redacted>"
    for key in ("num_running_reqs", "num_waiting_reqs", "kv_used_tokens", "kv_total_tokens", "cache_hit_rate"):
        assert key in info
    assert info["kv_total_tokens"] == 16384


def test_metrics(server):
    stream(server, text=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    r = server.get("/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    values = metric_values(r.text)
    assert values["braid:time_to_first_token_seconds_count"] >= 1
    assert values["braid:time_per_output_token_seconds_count"] >= 3
    assert values["braid:generation_tokens_total"] >= 4 and values["braid:prompt_tokens_total"] >= 6
    for name in ("braid:num_requests_running", "braid:num_requests_waiting", "braid:gpu_cache_usage_perc",
                 "braid:gpu_prefix_cache_hit_rate"):
        assert name in values
    assert requests.get(server.base_url + "/metrics", timeout=10).status_code == 401  # behind the key too
