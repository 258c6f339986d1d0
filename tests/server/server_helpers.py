"""Shared by the server tests: the session server's settings, a thin HTTP wrapper, SSE reading."""

import json
import subprocess
from dataclasses import dataclass

import requests

API_KEY = "test-key"
MAX_BODY_BYTES = 1 << 20
SERVER_FLAGS = ["--max-total-tokens", "32768", "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES),
                "--shutdown-timeout-s", "30", "--log-level", "warning"]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: str

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.base_url + path, headers=kw.pop("headers", self.headers), timeout=120, **kw)

    def post(self, path: str, json=None, **kw) -> requests.Response:  # noqa: A002 - requests' own name
        return requests.post(self.base_url + path, json=json, headers=kw.pop("headers", self.headers), timeout=120, **kw)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


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
