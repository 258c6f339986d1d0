"""The HTTP backends retry requests a server sheds (HTTP 429 and 503), bounded, honouring Retry-After, against a
real local server: lang_fake_server.FakeServer answering its first requests with the shedding status."""

import asyncio
import email.utils
import io
import json
import logging
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

import braid
from braid.backends.base import Prompt
from braid.backends.retry import DEFAULT_MAX_RETRIES, RetryPolicy, parse_retry_after
from braid.backends.runtime import Runtime
from braid.backends.runtime_endpoint import RuntimeEndpoint
from braid.runtime.sampling_params import SamplingParams

from lang_fake_server import REPLY, FakeServer

HERE = Path(__file__).resolve().parent
BUSY = "this client already has 4 requests waiting for their grammar to compile; try again later"


class SheddingServer:
    """A FakeServer whose first `shed` POSTs (of those whose body `only` accepts) get `status` with an OpenAI
    error object carrying `message` (and a Retry-After header when `retry_after` is given); other POSTs get the
    fake's usual answers. With `break_stream`, a shed POST instead gets a 200 event stream that ends in an error
    event after one chunk. `arrivals` holds the time each POST arrived."""

    def __init__(self, shed: int, status: int = 429, retry_after=None, message: str = BUSY,
                 break_stream: bool = False, only=lambda body: True):
        self.shed, self.status, self.retry_after, self.message = shed, status, retry_after, message
        self.break_stream, self.only = break_stream, only
        self.arrivals: list[float] = []
        self.shed_count = 0
        self._lock = threading.Lock()
        self.fake = FakeServer()
        outer = self

        class Handler(self.fake.httpd.RequestHandlerClass):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer._lock:
                    outer.arrivals.append(time.monotonic())
                    shed = outer.shed_count < outer.shed and outer.only(json.loads(raw or b"{}"))
                    outer.shed_count += shed
                if not shed:
                    # the fake reads the body again; the connection's own stream is put back after, or the next
                    # request on this keep-alive connection would read an empty stream and the server close it
                    # under the client
                    connection_stream, self.rfile = self.rfile, io.BytesIO(raw)
                    try:
                        return super().do_POST()
                    finally:
                        self.rfile = connection_stream
                if outer.break_stream:
                    return self._broken_stream()
                data = json.dumps({"error": {"message": outer.message, "type": "rate_limit_error", "param": None,
                                             "code": outer.status}}).encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if outer.retry_after is not None:
                    self.send_header("Retry-After", outer.retry_after)
                self.end_headers()
                self.wfile.write(data)

            def _broken_stream(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(b'data: {"text": "fa", "meta_info": {}}\n\n')
                self.wfile.flush()
                time.sleep(0.05)
                self.wfile.write(b'data: {"error": {"message": "the scheduler died", "type": "server_error"}}\n\n')
                self.close_connection = True

        self.fake.httpd.RequestHandlerClass = Handler
        self.url = self.fake.url

    @property
    def posts(self) -> int:
        with self._lock:
            return len(self.arrivals)

    def gaps(self) -> list[float]:
        with self._lock:
            return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


@pytest.fixture
def serve():
    servers = []

    def start(*args, **kwargs) -> SheddingServer:
        server = SheddingServer(*args, **kwargs)
        server.fake.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.fake.stop()


def _prompt() -> Prompt:
    return Prompt(text="hello")


@braid.function
def chat(s):
    s += braid.user("hi")
    s += braid.assistant(braid.gen("a", max_tokens=20))


# ---- the policy ---------------------------------------------------------------------------------------
def test_retry_after_parsing():
    assert parse_retry_after("2") == 2.0 and parse_retry_after(" 0 ") == 0.0 and parse_retry_after("0.5") == 0.5
    soon = email.utils.formatdate(time.time() + 5, usegmt=True)
    assert 3.0 <= parse_retry_after(soon) <= 5.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date gone by: retry now
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None and parse_retry_after("nan") is None


def test_policy_bounds_caps_and_backs_off():
    policy = RetryPolicy(max_retries=3)
    assert policy.retry_delay(429, "3600", 0, "x", "busy") == policy.max_sleep_s == 30.0
    assert policy.retry_delay(503, "1", 2, "x", "busy") == 1.0
    assert policy.retry_delay(429, "1", 3, "x", "busy") is None  # retries spent
    for status in (400, 404, 500, 502):
        assert policy.retry_delay(status, "1", 0, "x", "no") is None
    for n, (low, high) in enumerate([(0.125, 0.25), (0.25, 0.5), (0.5, 1.0)]):
        assert low <= policy.retry_delay(429, None, n, "x", "busy") <= high
    assert RetryPolicy(max_retries=40).retry_delay(429, None, 39, "x", "busy") <= 8.0
    assert RetryPolicy().max_retries == DEFAULT_MAX_RETRIES == 6
    for bad in (-1, 1.5, None, True):
        with pytest.raises(ValueError, match="max_retries"):
            RetryPolicy(max_retries=bad)


# ---- RuntimeEndpoint ----------------------------------------------------------------------------------
def test_endpoint_retries_429_waiting_as_retry_after_says(serve, caplog):
    server = serve(shed=2, retry_after="1")
    with caplog.at_level(logging.INFO, logger="braid.backends.retry"):
        out = RuntimeEndpoint(server.url).generate(_prompt(), SamplingParams())
    assert out.text == REPLY
    assert server.posts == 3
    assert all(0.9 <= gap < 5.0 for gap in server.gaps()), server.gaps()
    retries = [r.getMessage() for r in caplog.records if r.name == "braid.backends.retry"]
    assert len(retries) == 2 and all("HTTP 429" in m and "try again later" in m for m in retries), retries
    assert "retry 2 of 6" in retries[1]


def test_endpoint_retries_503_without_retry_after_by_growing_backoff(serve):
    server = serve(shed=3, status=503, message="the server is shutting down")
    out = RuntimeEndpoint(server.url).generate(_prompt(), SamplingParams())
    assert out.text == REPLY and server.posts == 4
    gaps = server.gaps()
    assert gaps[0] >= 0.12 and gaps[2] >= 0.5 and gaps[2] > gaps[0] and max(gaps) < 3.0, gaps


@pytest.mark.parametrize("status, error", [(429, braid.BackendRequestError), (503, braid.BackendError)])
def test_endpoint_gives_up_after_max_retries_with_the_server_message(serve, status, error):
    server = serve(shed=100, status=status, retry_after="0")
    with pytest.raises(error) as info:
        RuntimeEndpoint(server.url, max_retries=3).generate(_prompt(), SamplingParams())
    assert server.posts == 4
    assert "try again later" in str(info.value) and "after 4 attempts" in str(info.value)
    assert f"({status})" in str(info.value)
    if status == 429:
        assert info.value.status == 429


@pytest.mark.parametrize("status, error", [(400, braid.BackendRequestError), (500, braid.BackendError)])
def test_endpoint_does_not_retry_other_errors(serve, status, error):
    server = serve(shed=100, status=status, retry_after="0", message="bad regex")
    with pytest.raises(error, match="bad regex") as info:
        RuntimeEndpoint(server.url).generate(_prompt(), SamplingParams())
    assert server.posts == 1 and "attempts" not in str(info.value)


def test_endpoint_stream_and_async_calls_retry_then_give_up(serve):
    streamed = serve(shed=2, retry_after="0")
    pieces = list(RuntimeEndpoint(streamed.url).generate_stream(_prompt(), SamplingParams()))
    assert "".join(text for text, _ in pieces) == REPLY and streamed.posts == 3

    awaited = serve(shed=2, status=503, retry_after="0")
    out = asyncio.run(RuntimeEndpoint(awaited.url).agenerate(_prompt(), SamplingParams()))
    assert out.text == REPLY and awaited.posts == 3

    refused = serve(shed=100, retry_after="0")
    with pytest.raises(braid.BackendRequestError, match="try again later.*after 2 attempts"):
        list(RuntimeEndpoint(refused.url, max_retries=1).generate_stream(_prompt(), SamplingParams()))
    with pytest.raises(braid.BackendRequestError, match="try again later.*after 2 attempts"):
        asyncio.run(RuntimeEndpoint(refused.url, max_retries=1).agenerate(_prompt(), SamplingParams()))
    assert refused.posts == 4


def test_endpoint_does_not_retry_a_stream_whose_body_was_read(serve):
    server = serve(shed=1, break_stream=True)
    received = []
    with pytest.raises(braid.BackendError, match="the scheduler died"):
        for text, _ in RuntimeEndpoint(server.url).generate_stream(_prompt(), SamplingParams()):
            received.append(text)
    assert received == ["fa"] and server.posts == 1


def _constrained(body: dict) -> bool:
    return "json_schema" in body.get("sampling_params", {})


def test_run_batch_completes_while_the_server_sheds_load(serve, programs):
    # as braid's server with --grammar-max-queued-per-client 4: 12 of 16 schema-constrained gens get 429 at first
    sentences = [{"sentence": f"Person {i} is {20 + i} years old."} for i in range(16)]
    shedding = serve(shed=12, retry_after="1", only=_constrained)
    states = programs.extract_person.run_batch(sentences, backend=RuntimeEndpoint(shedding.url), num_threads=16,
                                               progress_bar=False)
    failures = [s for s in states if isinstance(s, BaseException)]
    assert not failures, failures[:2]
    assert all(programs.Person.model_validate_json(s["person"]) for s in states)
    assert shedding.shed_count == 12

    without_retries = serve(shed=12, retry_after="1", only=_constrained)
    states = programs.extract_person.run_batch(sentences, backend=RuntimeEndpoint(without_retries.url, max_retries=0),
                                               num_threads=16, progress_bar=False)
    failures = [s for s in states if isinstance(s, BaseException)]
    assert failures and all(isinstance(f, braid.BackendRequestError) and f.status == 429 for f in failures)


def test_runtime_hands_max_retries_to_its_endpoint_not_the_server(tmp_path):
    launcher = tmp_path / "fake_python"  # `fake_python -m braid.launch_server ARGS` serves the fake on --port
    launcher.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{HERE / "lang_fake_server.py"}" "$@"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    runtime = Runtime(model_path="smollm2", python=str(launcher), max_retries=2, startup_timeout=60)
    try:
        assert runtime.endpoint.retry_policy.max_retries == 2
        assert "--max-retries" not in runtime.command and runtime.command[1:3] == ["-m", "braid.launch_server"]
    finally:
        runtime.shutdown()
    assert RuntimeEndpoint("http://127.0.0.1:9").retry_policy.max_retries == DEFAULT_MAX_RETRIES
    with pytest.raises(ValueError, match="max_retries"):
        RuntimeEndpoint("http://127.0.0.1:9", max_retries=-1)


# ---- OpenAI -------------------------------------------------------------------------------------------
def _openai(server: SheddingServer, **kwargs) -> "braid.OpenAI":
    return braid.OpenAI("smollm2", base_url=server.url + "/v1", api_key="k", **kwargs)


def test_openai_retries_429_waiting_as_retry_after_says(serve):
    server = serve(shed=2, retry_after="1")
    backend = _openai(server)
    assert backend.client.max_retries == DEFAULT_MAX_RETRIES
    assert chat.run(backend=backend)["a"] == "chat reply"
    assert server.posts == 3
    assert all(0.9 <= gap < 5.0 for gap in server.gaps()), server.gaps()


def test_openai_stream_retries_503(serve):
    server = serve(shed=1, status=503, retry_after="0.01")
    state = chat.run(backend=_openai(server), stream=True)
    assert "".join(state.text_iter("a")) == "chat reply"
    assert server.posts == 2


def test_openai_gives_up_after_max_retries_with_the_server_message(serve):
    server = serve(shed=100, retry_after="0.01")
    with pytest.raises(braid.BackendRequestError, match="try again later") as info:
        chat.run(backend=_openai(server, max_retries=3))
    assert info.value.status == 429 and server.posts == 4


def test_openai_does_not_retry_400(serve):
    server = serve(shed=100, status=400, retry_after="0", message="bad regex")
    with pytest.raises(braid.BackendRequestError, match="bad regex") as info:
        chat.run(backend=_openai(server))
    assert info.value.status == 400 and server.posts == 1


# ---- LiteLLM ------------------------------------------------------------------------------------------
def _litellm(server: SheddingServer, **kwargs) -> "braid.LiteLLM":
    return braid.LiteLLM("openai/smollm2", api_base=server.url + "/v1", api_key="k", **kwargs)


def test_litellm_retries_shed_requests_past_its_clients_own_retries(serve):
    # its openai client tries each request 3 times (2 retries), so 4 sheds reach braid's retry once
    server = serve(shed=4, retry_after="0.01")
    assert chat.run(backend=_litellm(server))["a"] == "chat reply"
    assert server.posts == 5


def test_litellm_gives_up_and_does_not_retry_400(serve):
    shedding = serve(shed=100, retry_after="0.01")
    with pytest.raises(braid.BackendRequestError, match="try again later") as info:
        chat.run(backend=_litellm(shedding, max_retries=1))
    assert info.value.status == 429 and shedding.posts == (1 + 1) * 3

    rejecting = serve(shed=100, status=400, message="bad regex")
    with pytest.raises(braid.BackendRequestError, match="bad regex"):
        chat.run(backend=_litellm(rejecting))
    assert rejecting.posts == 1
