"""SIGTERM drains in-flight requests, refuses new ones, then the server and its scheduler process exit. The test
stops a server of its own, so it may run in any order beside the folder's shared one."""

import signal
import threading
import time

import pytest
from real_server import start_server
from server_helpers import API_KEY, SERVER_FLAGS, process_alive, sse_events


@pytest.fixture
def own_server():
    srv = start_server(SERVER_FLAGS, API_KEY, "braid-shutdown-")
    yield srv
    srv.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]



def test_sigterm_drains_then_exits(own_server):
    server = own_server
    children = _children(server.proc.pid)
    assert len(children) == 1
    first_chunk, events, errors = threading.Event(), [], []

    def run():
        try:
            r = server.post("/generate", stream=True, json={"text": "Count: 1, 2, 3,", "stream": True,
                            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}})
            events.extend(sse_events(_Tap(r, first_chunk)))
        except Exception as e:  # surfaced by the assertions below
            errors.append(e)
            first_chunk.set()

    t = threading.Thread(target=run)
    t.start()
    assert first_chunk.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = server.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
    t.join(60)
    assert not errors and events
    meta = events[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 24  # drained, not cut
    assert server.proc.wait(60) == 0
    deadline = time.time() + 10
    while process_alive(children[0]) and time.time() < deadline:
        time.sleep(0.1)
    assert not process_alive(children[0])


class _Tap:
    """Passes a streaming response through, setting an event at its first line."""

    def __init__(self, resp, event):
        self._resp, self._event = resp, event
        self.status_code, self.headers, self.text = resp.status_code, resp.headers, ""

    def iter_lines(self):
        for line in self._resp.iter_lines():
            if line:
                self._event.set()
            yield line
