"""A real braid server process for tests: started on a free loopback port, waited for until /health answers,
stopped with SIGTERM (then killed). Used by tests/server and tests/reliability."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest
import requests

START_TIMEOUT_S = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: str
    api_key: str

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def get(self, path: str, timeout: float = 120, **kw) -> requests.Response:
        return requests.get(self.base_url + path, headers=kw.pop("headers", self.headers), timeout=timeout, **kw)

    def post(self, path: str, json=None, timeout: float = 120, **kw) -> requests.Response:  # noqa: A002
        return requests.post(self.base_url + path, json=json, headers=kw.pop("headers", self.headers),
                             timeout=timeout, **kw)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.log_path):
            os.unlink(self.log_path)


def start_server(flags: list[str], api_key: str, log_prefix: str, env: dict | None = None,
                 server_cls: type = Server) -> Server:
    """`python -m braid.runtime.launch` with `flags` on a free port; fails the test if it dies or stays unhealthy."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)
    # one torch thread: the scheduler shares the 2 cores with the HTTP server and the test's clients, and
    # two spinning intra-op threads on a busy machine run several times slower than one
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("BRAID_TEST_SERVER_THREADS", "1"), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "braid.runtime.launch", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=full_env)
    srv = server_cls(proc, f"http://127.0.0.1:{port}", log.name, api_key)
    deadline = time.time() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during start-up:\n{srv.log_tail()}")
        try:
            if requests.get(srv.base_url + "/health", timeout=2).status_code == 200:
                return srv
        except requests.ConnectionError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy after {START_TIMEOUT_S}s:\n{srv.log_tail()}")
        time.sleep(0.3)
