"""Launch failures end the process promptly, with exit code 1 and the reason."""

import socket
import subprocess
import sys


def launch(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "braid.runtime.launch", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_port_in_use_fails_before_loading_anything():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = launch("--port", str(port), timeout=60)
    assert r.returncode == 1 and f"cannot serve on 127.0.0.1:{port}" in r.stderr


def test_bad_model_path_reports_the_schedulers_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = launch("--port", str(port), "--model-path", "/no/such/model")
    assert r.returncode == 1, r.stderr
    assert "scheduler failed to start" in r.stderr and "/no/such/model" in r.stderr


def test_unbuilt_parallelism_fails_at_start_in_one_line():
    for flag in ("--tp-size", "--dp-size"):
        r = launch(flag, "2", timeout=60)
        assert r.returncode == 2 and "not built yet" in r.stderr and f"{flag[2:4]}_size=2" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "usage:" not in r.stderr and len(r.stderr.splitlines()) == 1
