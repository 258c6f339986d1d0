"""Shutdown and scheduler death as a client and a supervisor see them: /health turns 503 at once and stays
503 until the process exits; a request cut at shutdown keeps its text; no connection is left waiting at exit."""

import os
import signal
import socket
import threading
import time

import requests
from reliability_servers import start_server

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


def _poll_raw(port: int, stop: threading.Event, durations: list[float]) -> None:
    """GET /health on one fresh connection after another until `stop`: how long each took to be answered, closed or
    refused (a connection left waiting takes the whole socket timeout)."""
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    while not stop.is_set():
        began = time.perf_counter()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=4) as sock:
                sock.sendall(request)
                while sock.recv(4096):
                    pass
        except OSError:  # refused or reset: as prompt as an answer
            pass
        durations.append(time.perf_counter() - began)


def test_scheduler_death_exit_leaves_no_connection_waiting():
    """Clients connecting as fast as they can while the server exits: each connection is answered, closed or refused
    at once. aiohttp's cleanup used to leave one accepted just before it unanswered for its 5 s shutdown timeout."""
    srv = start_server("--max-total-tokens", "2048")
    port = int(srv.base_url.rsplit(":", 1)[1])
    stop, durations = threading.Event(), []
    # enough clients that one is often connecting just as the server closes its listener
    clients = [threading.Thread(target=_poll_raw, args=(port, stop, durations)) for _ in range(16)]
    try:
        os.kill(srv.scheduler_pid(), signal.SIGKILL)
        for t in clients:
            t.start()
        assert srv.proc.wait(30) == 1
    finally:
        stop.set()
        for t in clients:
            t.join()
        srv.stop()
    slow = sorted(d for d in durations if d > 2.0)
    print(f"{len(durations)} connections while the server exited, slowest {max(durations):.3f}s")
    assert not slow, f"{len(slow)} connection(s) left waiting: {slow}"
