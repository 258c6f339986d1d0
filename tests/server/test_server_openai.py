"""The OpenAI API through the official `openai` client (sync, async, streaming)."""

import asyncio
import json

import openai
import pytest

from server_helpers import API_KEY

CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]


def collect_chat_stream(chunks):
    """texts per choice, finish reasons per choice (each must appear once, in that choice's last chunk), usage."""
    texts, finishes, last_seen, usage = {}, {}, {}, None
    for i, ch in enumerate(chunks):
        if not ch.choices:
            usage = ch.usage
            continue
        assert usage is None, "usage chunk must be the last"
        for c in ch.choices:
            assert c.index not in finishes, f"chunk after the finish of choice {c.index}"
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
            last_seen[c.index] = i
    return texts, finishes, usage


def test_models(openai_client, model_name):
    models = openai_client.models.list().data
    assert [m.id for m in models] == [model_name]


def test_chat_stream_equals_non_stream(openai_client, model_name):
    full = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12 and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    texts, finishes, usage = collect_chat_stream(chunks)
    assert texts == {0: choice.message.content} and finishes == {0: choice.finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert usage.prompt_tokens == full.usage.prompt_tokens and usage.completion_tokens == full.usage.completion_tokens


def test_chat_n_logprobs_and_max_completion_tokens(openai_client, model_name):
    r = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_completion_tokens=5, n=2,
                                              temperature=0.9, seed=11, logprobs=True, top_logprobs=4)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens <= 10
    for c in r.choices:
        lp = c.logprobs.content
        assert len(lp) >= 1 and all(len(t.top_logprobs) == 4 and t.logprob <= 0 for t in lp)
        assert "".join(t.token for t in lp) == c.message.content  # no stop or special token trimmed here
        if c.finish_reason == "length":
            assert len(lp) == 5
    again = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_completion_tokens=5, n=2,
                                                  temperature=0.9, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded
    chunks = list(openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, n=2,
                                                        temperature=0.9, seed=11, stream=True))
    texts, finishes, _ = collect_chat_stream(chunks)
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    assert set(finishes) == {0, 1}


def test_async_client_streams_the_same(openai_client, model_name, server):
    sync = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10, temperature=0)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
        full = await client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10, temperature=0)
        text = ""
        async for ch in await client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10,
                                                             temperature=0, stream=True):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
        await client.close()
        return full.choices[0].message.content, text

    full, streamed = asyncio.run(run())
    assert full == streamed == sync.choices[0].message.content


def test_completions_stream_stop_echo_and_logprobs(openai_client, model_name):
    prompt = "1, 2, 3, 4,"
    full = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert text.startswith(" 5, 6")
    chunks = list(openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert sum(c.choices[0].finish_reason is not None for c in chunks if c.choices) == 1
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    stopped = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0, stop=[" 7"])
    assert stopped.choices[0].text == text[: text.find(" 7")] and stopped.choices[0].finish_reason == "stop"

    lp = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                          echo=True)
    c = lp.choices[0]
    assert c.text.startswith(prompt)
    assert len(c.logprobs.tokens) == lp.usage.prompt_tokens + 3 and c.logprobs.token_logprobs[0] is None
    assert "".join(c.logprobs.tokens) == c.text
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs[1:])

    batch = openai_client.completions.create(model=model_name, prompt=[prompt, "a, b, c,"], max_tokens=4, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1] and batch.choices[0].text == text[: len(batch.choices[0].text)]


def test_extra_sampling_fields(openai_client, model_name, server):
    base = openai_client.completions.create(model=model_name, prompt="Hello", max_tokens=6, temperature=0)
    topk = openai_client.completions.create(model=model_name, prompt="Hello", max_tokens=6, temperature=1.5, seed=3,
                                            extra_body={"top_k": 1})
    assert topk.choices[0].text == base.choices[0].text  # top_k=1 is greedy whatever the temperature
    native = server.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    ids = native["output_ids"]
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])
    before = server.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": k, "temperature": 0}}).json()
    stopped = openai_client.completions.create(model=model_name, prompt="Hello", max_tokens=6, temperature=0,
                                               extra_body={"stop_token_ids": [ids[k]]})
    assert stopped.choices[0].text == before["text"] and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["matched_stop"] == ids[k]
    eos = openai_client.completions.create(model=model_name, prompt="Hello", max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True, "min_p": 0.1, "repetition_penalty": 1.05})
    assert eos.usage.completion_tokens == 8 and eos.choices[0].finish_reason == "length"


def test_json_response_formats(openai_client, model_name):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    r = openai_client.completions.create(model=model_name, prompt="The year is", max_tokens=8, temperature=0,
                                         extra_body={"regex": " [0-9]{4}"})
    assert len(r.choices[0].text) == 5 and r.choices[0].text[1:].isdigit()


def test_json_object_response_format(openai_client, model_name):
    r = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Give me JSON."}], max_tokens=30, temperature=0,
        response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert r.choices[0].finish_reason == "length" and text.startswith("{")


def test_openai_errors_are_error_objects(openai_client, model_name):
    with pytest.raises(openai.NotFoundError) as ei:
        openai_client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert ei.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as ei:
        openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=2, top_p=2.0)
    assert ei.value.body["param"] == "top_p" and ei.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=openai_client.base_url, api_key="wrong", max_retries=0).models.list()
