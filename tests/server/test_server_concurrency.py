"""64 concurrent streaming clients, a third of them hanging up mid-stream: the rest are unaffected, and
every aborted request gives its KV back."""

import asyncio
import json
import socket
import time
from urllib.parse import urlparse

import openai

from server_helpers import API_KEY, metric_values, wait_idle

PROMPTS = ["Write a word that rhymes with cat.", "What is 2 + 2?", "Name a planet.", "Say something about dogs."]
MAX_TOKENS = 8
LEAVER_MAX_TOKENS = 1000  # far more than the test waits for: only an abort ends these in time


def messages(i: int) -> list:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


async def stream_text(client, model: str, i: int) -> str:
    text = ""
    stream = await client.chat.completions.create(model=model, messages=messages(i), max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
    async for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
    return text


async def leave_early(client, model: str, i: int) -> int:
    stream = await client.chat.completions.create(model=model, messages=messages(i), max_tokens=LEAVER_MAX_TOKENS,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()  # drops the connection mid-stream
    return seen


def test_non_streaming_client_that_hangs_up_is_aborted(server):
    body = json.dumps({"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
    url = urlparse(server.base_url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall((f"POST /generate HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {API_KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.time() + 30
        while server.get("/get_server_info").json()["num_running_reqs"] == 0:
            assert time.time() < deadline, "the request never started"
            time.sleep(0.1)
    wait_idle(server)  # 3000 tokens would take minutes: only the abort ends it this soon


def test_disconnects_do_not_disturb_others_and_free_kv(server, model_name):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        alone = [await stream_text(client, model_name, i) for i in range(len(PROMPTS))]
        jobs = [leave_early(client, model_name, i) if i % 3 == 0 else stream_text(client, model_name, i)
                for i in range(64)]
        results = await asyncio.gather(*jobs)
        await client.close()
        return alone, results

    alone, results = asyncio.run(run())
    for i, got in enumerate(results):
        if i % 3 == 0:
            assert got == 3
        else:
            assert got == alone[i % len(PROMPTS)], f"client {i}"

    info = wait_idle(server)
    assert info["num_server_requests"] == 0
    metrics = server.get("/metrics").text
    aborted = metric_values(metrics)["braid:requests_aborted_total"]
    assert aborted >= 22
