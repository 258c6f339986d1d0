"""One real server process on SmolLM2 for the whole session (started on first use), plus clients."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import requests

from server_helpers import API_KEY, SERVER_FLAGS, Server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server():
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="braid-server-", suffix=".log", delete=False)
    # one torch thread: the scheduler shares the 2 cores with the HTTP server and the test's clients, and
    # two spinning intra-op threads on a busy machine run several times slower than one
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("BRAID_TEST_SERVER_THREADS", "1")}
    proc = subprocess.Popen([sys.executable, "-m", "braid.runtime.launch", "--port", str(port), *SERVER_FLAGS],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(proc, f"http://127.0.0.1:{port}", log.name)
    deadline = time.time() + 400
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during start-up:\n{srv.log_tail()}")
        try:
            if requests.get(srv.base_url + "/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy after 400s:\n{srv.log_tail()}")
        time.sleep(0.5)
    yield srv
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    os.unlink(log.name)


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(server):
    return server.get("/v1/models").json()["data"][0]["id"]
