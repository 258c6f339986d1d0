"""The server's per-step output path under load, on a one-layer dummy Llama with SmolLM2's vocabulary (cheap steps,
so hundreds of streams decode at once): streamed text equals the non-streamed text of the same request for the
native and both OpenAI routes with stop strings and n > 1, and /health answers quickly while 200 streams decode."""

import asyncio
import json
import time

import aiohttp
import openai
import pytest
import requests

from real_server import start_server

API_KEY = "stream-load-key"
TINY_LLAMA_SMOLLM2_VOCAB = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 49152,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2}
# random weights emit word pieces; these stops end some outputs early, in the middle of a token or across two
STOPS = ["e ", "in", "."]
NUM_PROMPTS = 40
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_server():
    srv = start_server(["--model-path", "smollm2", "--load-format", "dummy", "--model-config",
                        json.dumps(TINY_LLAMA_SMOLLM2_VOCAB), "--max-total-tokens", "131072",
                        "--max-running-requests", "512", "--log-level", "warning"], API_KEY, "braid-stream-load-")
    yield srv
    srv.stop()


def prompt(i: int) -> str:
    return f"Request {i}: tell me about the number {i * 7919 % 1000} and the letter {chr(97 + i % 26)}."


async def native(session, base: str, i: int, stream: bool) -> dict:
    """{index: (text, finish_reason)} of a /generate batch of two prompts (i, i + 1), n = 2 each."""
    body = {"text": [prompt(i), prompt(i + 1)], "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "n": 2, "stop": STOPS}}
    async with session.post(base + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            return {k: (r["text"], r["meta_info"]["finish_reason"]) for k, r in enumerate(await resp.json())}
        texts: dict = {}
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            previous = texts.get(chunk["index"], ("", None))[0]
            assert chunk["text"].startswith(previous)  # cumulative: never loses or rewrites what was sent
            texts[chunk["index"]] = (chunk["text"], chunk["meta_info"]["finish_reason"])
        return texts


async def completion(client, model: str, i: int, stream: bool) -> dict:
    kw = dict(model=model, prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=0, n=2, stop=STOPS)
    if not stream:
        r = await client.completions.create(**kw)
        return {c.index: (c.text, c.finish_reason) for c in r.choices}
    texts, reasons = {}, {}
    async for chunk in await client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return {k: (texts[k], reasons.get(k)) for k in texts}


async def chat(client, model: str, i: int, stream: bool) -> dict:
    kw = dict(model=model, messages=[{"role": "user", "content": prompt(i)}], max_tokens=MAX_TOKENS, temperature=0,
              n=2, stop=STOPS)
    if not stream:
        r = await client.chat.completions.create(**kw)
        return {c.index: (c.message.content, c.finish_reason) for c in r.choices}
    texts, reasons = {}, {}
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return {k: (texts[k], reasons.get(k)) for k in texts}


def test_streams_equal_non_streamed_text_with_stops_and_n(tiny_server):
    """Every request is sent twice at the same moment, streamed and not, so each pair decodes in the same steps."""
    model = tiny_server.get("/v1/models").json()["data"][0]["id"]

    async def run():
        client = openai.AsyncOpenAI(base_url=tiny_server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                                    timeout=300)
        async with aiohttp.ClientSession(headers=tiny_server.headers, connector=aiohttp.TCPConnector(limit=0)) as s:
            jobs = []
            for i in range(NUM_PROMPTS):
                for route in (lambda st, i=i: native(s, tiny_server.base_url, 2 * i, st),
                              lambda st, i=i: completion(client, model, i, st),
                              lambda st, i=i: chat(client, model, i, st)):
                    jobs += [route(True), route(False)]
            results = await asyncio.gather(*jobs)
        await client.close()
        return results

    results = asyncio.run(run())
    stopped_by_string = 0
    for k in range(0, len(results), 2):
        streamed, whole = results[k], results[k + 1]
        assert streamed.keys() == whole.keys() and len(whole) in (2, 4)
        for index, (text, reason) in whole.items():
            assert streamed[index][0] == text, (k, index)
            if isinstance(reason, dict):  # native: the finish reason object, compared whole
                assert streamed[index][1] == reason
                stopped_by_string += reason["type"] == "stop" and isinstance(reason["matched"], str)
            else:
                assert streamed[index][1] == reason
    assert stopped_by_string > 0  # the stop strings did end some outputs
    info = tiny_server.get("/get_server_info").json()
    assert info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0


def test_health_stays_responsive_while_200_streams_decode(tiny_server):
    async def stream_one(session, i: int) -> int:
        body = {"text": prompt(i), "stream": True,
                "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}}
        chunks = 0
        async with session.post(tiny_server.base_url + "/generate", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                chunks += line.startswith(b"data: {")
        return chunks

    async def run():
        async with aiohttp.ClientSession(headers=tiny_server.headers, connector=aiohttp.TCPConnector(limit=0)) as s:
            return await asyncio.gather(*(stream_one(s, i) for i in range(200)))

    latencies: list[float] = []
    done = []

    def poll_health():
        while not done:
            t0 = time.perf_counter()
            assert requests.get(tiny_server.base_url + "/health", timeout=10).status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)

    import threading

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        chunks = asyncio.run(run())
    finally:
        done.append(True)
        poller.join()
    assert all(c >= 2 for c in chunks)  # every request streamed (stream_interval 1: a chunk per step)
    assert len(latencies) >= 10
    assert max(latencies) < 0.5, sorted(latencies)[-5:]
