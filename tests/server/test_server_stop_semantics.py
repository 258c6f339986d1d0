"""Stop semantics over HTTP, as vLLM 0.6 / SGLang users expect them: min_tokens (min_new_tokens) holds off stop
strings, and include_stop_str_in_output (no_stop_trim) keeps a stop token's text; streamed and non-streamed agree."""

import pytest

from server_helpers import sse_events

THE = 260  # SmolLM2's " the"
MIN_TOKENS_REQUEST = {"prompt": "The end.", "temperature": 0, "max_tokens": 50, "min_tokens": 40}


def completion(server, **body) -> dict:
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_completion(server, **body) -> tuple[str, str, dict]:
    events = sse_events(server.post("/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}},
                                    stream=True))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    return text, finish[-1], events[-1]["usage"]


def generate(server, **body) -> dict:
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_min_tokens_holds_off_stop_strings_on_completions(server):
    reference = completion(server, **MIN_TOKENS_REQUEST)["choices"][0]["text"]
    assert reference.startswith("\n") and "\n" in reference[1:], "the output needs early newlines to test this"
    out = completion(server, **MIN_TOKENS_REQUEST, stop=["\n"])
    text, usage = out["choices"][0]["text"], out["usage"]
    assert usage["completion_tokens"] >= 40
    assert text.startswith("\n") and reference.startswith(text)
    if out["choices"][0]["finish_reason"] == "stop" and text != reference:
        assert reference[len(text)] == "\n"
    assert streamed_completion(server, **MIN_TOKENS_REQUEST, stop=["\n"]) == (
        text, out["choices"][0]["finish_reason"], usage)


def test_min_new_tokens_holds_off_stop_strings_on_generate(server):
    sp = {"temperature": 0, "max_new_tokens": 30, "min_new_tokens": 20, "stop": ["\n"]}
    out = generate(server, text="The end.", sampling_params=sp)
    meta = out["meta_info"]
    assert meta["completion_tokens"] >= 20 and out["text"].startswith("\n")
    if meta["finish_reason"]["type"] == "stop" and meta["finish_reason"]["matched"] == "\n":
        assert out["output_ids"][-1] == 198  # the newline that stopped it came after the 19th token
    events = sse_events(server.post("/generate", json={"text": "The end.", "sampling_params": sp, "stream": True},
                                    stream=True))
    assert events[-1]["text"] == out["text"] and events[-1]["output_ids"] == out["output_ids"]


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_token_on_completions(server, include):
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 30, "stop_token_ids": [THE]}
    plain = completion(server, **body)["choices"][0]
    out = completion(server, **body, include_stop_str_in_output=include)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == THE
    assert choice["text"] == (plain["text"] + " the" if include else plain["text"])
    assert streamed_completion(server, **body, include_stop_str_in_output=include)[:2] == (choice["text"], "stop")


def test_no_stop_trim_keeps_the_stop_token_on_generate(server):
    sp = {"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [THE]}
    trimmed = generate(server, text="Once upon a time", sampling_params=sp)
    kept = generate(server, text="Once upon a time", sampling_params={**sp, "no_stop_trim": True})
    assert kept["output_ids"] == trimmed["output_ids"] and kept["output_ids"][-1] == THE
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": THE}
    assert kept["text"] == trimmed["text"] + " the"
    events = sse_events(server.post("/generate", json={"text": "Once upon a time", "stream": True,
                                                       "sampling_params": {**sp, "no_stop_trim": True}}, stream=True))
    assert events[-1]["text"] == kept["text"]
