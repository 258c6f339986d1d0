"""Runtime: spawn `python -m braid.launch_server` on a free port and talk to it as a RuntimeEndpoint.

    runtime = braid.Runtime(model_path="smollm2", max_total_tokens=4096)
    braid.set_default_backend(runtime)
    ...
    runtime.shutdown()  # also done at interpreter exit

`max_retries` is its endpoint's (requests the server sheds with HTTP 429/503 are retried); every other keyword
argument is a server argument.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from braid.backends.retry import DEFAULT_MAX_RETRIES
from braid.backends.runtime_endpoint import RuntimeEndpoint
from braid.errors import ServerStartError

DEFAULT_STARTUP_TIMEOUT_S = 300.0
_LOG_TAIL_LINES = 40


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_args_to_cli(server_args: dict[str, Any]) -> list[str]:
    """{"max_total_tokens": 4096, "disable_radix_cache": True} -> ["--max-total-tokens", "4096", "--disable-radix-cache"].
    True booleans become bare flags; False and None are left out; lists repeat their values."""
    import json

    out: list[str] = []
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out.extend([flag, *map(str, value)])
        elif isinstance(value, dict):
            out.extend([flag, json.dumps(value)])
        else:
            out.extend([flag, str(value)])
    return out


def _die_with_parent_preexec():
    """On Linux, have the server get SIGTERM if this process dies without running atexit (e.g. it was
    killed). Only from the main thread: the kernel signals when the forking *thread* exits."""
    import threading

    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm)

    return preexec


class _StartupEcho:
    """Copies the server's INFO lines (loading the model, weights loaded, KV pool, ready on URL) from its log file to
    this process's stderr while it starts, so a program that starts a Runtime shows what it is waiting for. Errors
    are left to ServerStartError, which carries the log's tail, so they are shown once."""

    def __init__(self, log_path: str):
        self.log_path = log_path
        self.offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        self.partial = b""

    def echo_new_lines(self) -> None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            text = line.decode("utf-8", "replace")
            if " INFO " in text:
                print(text, file=sys.stderr, flush=True)


class Runtime:
    def __init__(self, model_path: str = "smollm2", *, host: str = "127.0.0.1", port: Optional[int] = None,
                 api_key: Optional[str] = None, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
                 log_path: Optional[str] = None, python: Optional[str] = None, env: Optional[dict] = None,
                 max_retries: int = DEFAULT_MAX_RETRIES, **server_args: Any):
        self.model_path = model_path
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.api_key = api_key
        args = {"model_path": model_path, "host": host, "port": self.port, "api_key": api_key, **server_args}
        self.command = [python or sys.executable, "-m", "braid.launch_server", *server_args_to_cli(args)]

        self._owns_log = log_path is None
        self._keep_log = False
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="braid-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.endpoint = RuntimeEndpoint(self.url, api_key=api_key, max_retries=max_retries)
        self._log = open(log_path, "ab")
        startup_echo = _StartupEcho(log_path)
        self._process: Optional[subprocess.Popen] = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
            preexec_fn=_die_with_parent_preexec(),
        )
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(startup_timeout, startup_echo)
        except BaseException:
            self._keep_log = True  # the error message points at it
            self.shutdown()
            raise

    # ---- lifecycle ------------------------------------------------------------------------------
    def _wait_healthy(self, timeout: float, startup_echo: _StartupEcho) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            startup_echo.echo_new_lines()
            code = self._process.poll()
            if code is not None:
                raise ServerStartError(f"braid server exited with code {code} before becoming healthy.\n"
                                       f"command: {' '.join(self.command)}\nlog tail ({self.log_path}):\n{self.log_tail()}")
            if self.endpoint.health(timeout=2.0):
                startup_echo.echo_new_lines()  # "ready on ..."
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"braid server not healthy after {timeout:.0f}s at {self.url}.\n"
                                       f"log tail ({self.log_path}):\n{self.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode("utf-8", "replace")
        except OSError:
            return "(log unavailable)"

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def shutdown(self, timeout: float = 15.0) -> None:
        proc, self._process = self._process, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
                proc.wait()
        self.endpoint.shutdown()
        if not self._log.closed:
            self._log.close()
            if self._owns_log and not self._keep_log:
                try:
                    os.unlink(self.log_path)
                except OSError:
                    pass
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- delegation -----------------------------------------------------------------------------
    def get_server_info(self) -> dict:
        return self.endpoint.get_server_info()

    def get_model_info(self) -> dict:
        return self.endpoint.get_model_info()

    def get_server_args(self) -> dict:
        return self.endpoint.get_server_args()

    @property
    def token_usage(self):
        return self.endpoint.token_usage

    def flush_cache(self) -> None:
        self.endpoint.flush_cache()

    def __repr__(self) -> str:
        return f"Runtime({self.model_path!r}, url={self.url!r}, alive={self.alive})"
