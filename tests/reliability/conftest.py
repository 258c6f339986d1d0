"""Real SmolLM2 servers with reliability-sized limits, started per test module (or per test when a test
stops its server)."""

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

API_KEY = "reliability-key"
BASE_FLAGS = ["--max-total-tokens", "8192", "--log-level", "warning"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: str
    api_key: str = API_KEY

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

    def scheduler_pid(self) -> int:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return int(f.read().split()[0])

    def idle_stats(self, timeout_s: float = 60) -> dict:
        """/get_server_info once no request is in flight."""
        deadline = time.time() + timeout_s
        while True:
            info = self.get("/get_server_info").json()
            idle = info["num_server_requests"] == 0 and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
            if idle or time.time() > deadline:
                return info
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log_path)


def start_server(*flags: str, env: dict | None = None, api_key: str = API_KEY) -> Server:
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="braid-reliability-", suffix=".log", delete=False)
    # the API key comes from the environment: it must work without --api-key on the command line
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("BRAID_TEST_SERVER_THREADS", "1"),
                "BRAID_API_KEY": api_key, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "braid.runtime.launch", "--port", str(port), *BASE_FLAGS, *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=full_env)
    srv = Server(proc, f"http://127.0.0.1:{port}", log.name, api_key)
    deadline = time.time() + 400
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
            pytest.fail(f"server not healthy after 400s:\n{srv.log_tail()}")
        time.sleep(0.3)


MAX_PROMPT_CHARS = 3_000_000
MAX_BODY_BYTES = 4 << 20
MAX_RUNNING, MAX_QUEUED = 2, 1


@pytest.fixture(scope="session")
def front_server():
    """Sized small: prompts of up to 3M characters, 4 MiB bodies, 2 running + 1 queued requests."""
    srv = start_server("--max-prompt-chars", str(MAX_PROMPT_CHARS), "--max-body-bytes", str(MAX_BODY_BYTES),
                       "--max-running-requests", str(MAX_RUNNING), "--max-queued-requests", str(MAX_QUEUED))
    yield srv
    srv.stop()
