"""A real server's log, written to a file (not a terminal): each start-up step once, in order, then "ready"; a
stats line while it serves; no carriage returns."""

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import requests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_log(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("startup") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "braid.runtime.launch", "--port", str(port),
                                 "--max-total-tokens", "2048", "--log-stats-interval-s", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 400
        while True:
            assert proc.poll() is None, f"server exited during start-up:\n{log_path.read_text()[-3000:]}"
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.time() < deadline, f"server not healthy after 400 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        startup_log = log_path.read_text()
        for _ in range(3):  # ~1 s each on 2 CPU cores: the stats line (every 1 s) falls inside
            r = requests.post(base + "/generate", json={"text": "Count to twenty:", "sampling_params": {
                "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}, timeout=120)
            assert r.status_code == 200, r.text
        time.sleep(0.5)
        yield startup_log, log_path.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


STARTUP_STEPS = [r"loading model \S+ \(LlamaForCausalLM, dtype float32, device cpu\)",
                 r"weights loaded: \d+ tensors in [\d.]+ s",
                 r"KV pool: 2048 tokens \([\d.]+ MiB\)",
                 r"scheduler started in [\d.]+ s",
                 r"ready on http://127\.0\.0\.1:\d+"]


def test_startup_steps_logged_once_each_in_order(served_log):
    startup_log, _ = served_log
    positions = []
    for step in STARTUP_STEPS:
        hits = [m.start() for m in re.finditer(step, startup_log)]
        assert len(hits) == 1, f"{step!r} logged {len(hits)} times:\n{startup_log}"
        positions.append(hits[0])
    assert positions == sorted(positions), startup_log
    tensors = int(re.search(r"weights loaded: (\d+) tensors", startup_log).group(1))
    assert tensors == 272  # SmolLM2-135M: 30 layers * 9 + embeddings + final norm (lm_head is tied)


def test_log_file_gets_no_progress_bar_redraws(served_log):
    _, full_log = served_log
    assert "\r" not in full_log
    assert "Loading weights" not in full_log


def test_stats_line_while_serving(served_log):
    _, full_log = served_log
    lines = re.findall(r"stats: #running-req: \d+, #queue-req: \d+, prefill: [\d.]+ tok/s, decode: [\d.]+ tok/s, "
                       r"KV usage: [\d.]+% \(\d+/2048 tokens\), cache hit rate: [\d.]+%", full_log)
    assert lines, full_log
