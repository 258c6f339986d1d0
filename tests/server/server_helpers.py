"""Shared by the server tests: the session server's settings and SSE reading (the server itself: tests/helpers/real_server.py)."""

import json
import time

import requests

API_KEY = "test-key"
MAX_BODY_BYTES = 1 << 20
SERVER_FLAGS = ["--max-total-tokens", "16384", "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES),
                "--shutdown-timeout-s", "30", "--log-level", "warning"]


def sse_events(resp: requests.Response) -> list:
    """Decoded `data:` payloads up to `[DONE]` (which must come last)."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events, done = [], False
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        assert not done, "data after [DONE]"
        if payload == b"[DONE]":
            done = True
            continue
        events.append(json.loads(payload))
    assert done, "stream ended without [DONE]"
    return events


def metric_values(text: str) -> dict:
    """Prometheus text -> {metric name (labels dropped): value}; a name with several label sets keeps the sum."""
    values: dict = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{", 1)[0]
            if 'le="' in sample:  # a histogram bucket keeps its bound: name{le="0.5"}
                name += '{le="' + sample.split('le="', 1)[1].split('"', 1)[0] + '"}'
            values[name] = values.get(name, 0.0) + float(value.replace("+Inf", "inf"))
    return values


def wait_idle(server, timeout_s: float = 30) -> dict:
    """/get_server_info once no request runs or waits and no KV slot is used (fails after timeout_s)."""
    deadline = time.time() + timeout_s
    while True:
        info = server.get("/get_server_info").json()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_used_tokens"] == 0:
            return info
        assert time.time() < deadline, f"requests still running or KV still held: {info}"
        time.sleep(0.2)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
