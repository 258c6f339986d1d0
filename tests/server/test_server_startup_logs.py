"""A real server's log, written to a file (not a terminal): each start-up step once, in order, then "ready"; a
stats line while it serves; no carriage returns."""

import re
import time
from pathlib import Path

import pytest
import requests
from real_server import start_server


@pytest.fixture(scope="module")
def served_log():
    srv = start_server(["--max-total-tokens", "2048", "--log-stats-interval-s", "1"], api_key="",
                       log_prefix="braid-startup-")
    try:
        startup_log = Path(srv.log_path).read_text()
        for _ in range(3):  # ~1 s each on 2 CPU cores: the stats line (every 1 s) falls inside
            r = requests.post(srv.base_url + "/generate", json={"text": "Count to twenty:", "sampling_params": {
                "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}, timeout=120)
            assert r.status_code == 200, r.text
        time.sleep(0.5)
        yield startup_log, Path(srv.log_path).read_text()
    finally:
        srv.stop()


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
