"""Shutdown and scheduler death as a client and a supervisor see them: /health turns 503 at once and stays
503 until the process exits; a request cut at shutdown keeps its text."""

import os
import signal
import threading
import time

import requests
from conftest import start_server

LONG = {"text": "Count to one thousand: 1, 2, 3,",
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}


def _health_until_exit(srv) -> list[int]:
    """Status codes of /health, polled until the server stops listening."""
    codes = []
    while True:
        try:
            codes.append(requests.get(srv.base_url + "/health", timeout=5).status_code)
        except requests.ConnectionError:
            return codes
        time.sleep(0.05)


def _wait_generating(srv, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while srv.get("/get_server_info").json()["num_running_reqs"] < 1:
        assert time.time() < deadline
        time.sleep(0.1)
    time.sleep(1.0)  # some tokens generated


def test_sigterm_health_503_at_once_and_cut_request_keeps_its_text():
    srv = start_server("--shutdown-timeout-s", "1")
    result = {}
    try:
        t = threading.Thread(target=lambda: result.setdefault("resp", srv.post("/generate", LONG)))
        t.start()
        _wait_generating(srv)
        signalled = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        first = requests.get(srv.base_url + "/health", timeout=5)
        first_s = time.perf_counter() - signalled
        codes = _health_until_exit(srv)
        t.join(60)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    print(f"/health after SIGTERM: {first.status_code} in {first_s * 1000:.0f} ms, then {len(codes)} polls")
    assert first.status_code == 503 and first.json()["error"]["type"] == "service_unavailable_error"
    assert codes and set(codes) == {503}
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    body = resp.json()
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "shutting down" in meta["finish_reason"]["message"]
    assert meta["completion_tokens"] > 0 and body["text"] and len(body["output_ids"]) == meta["completion_tokens"]


def test_scheduler_death_health_503_until_exit_and_exit_code_1():
    srv = start_server()
    try:
        os.kill(srv.scheduler_pid(), signal.SIGKILL)
        deadline = time.time() + 10
        while requests.get(srv.base_url + "/health", timeout=5).status_code == 200:
            assert time.time() < deadline
            time.sleep(0.05)
        codes = _health_until_exit(srv)
        assert srv.proc.wait(30) == 1
    finally:
        srv.stop()
    print(f"/health after the scheduler died: {len(codes)} polls, codes {set(codes)}")
    assert len(codes) >= 3 and set(codes) == {503}
