"""Regex -> outlines-core `Index` (token-level automaton), compiled in worker processes.

A regex can blow up into an exponential DFA (`(a|b)*a(a|b){25}`), and outlines-core has no size limit.
A thread running that could never be stopped, so compiles run in child processes: past the timeout
the child is killed, the waiting future fails, and a fresh child takes the next job.

Importable without torch (the child imports this module).
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe

WORKER_START_TIMEOUT_S = 120.0
WORKER_MEMORY_LIMIT_BYTES = 8 << 30  # address space of a compile child; past it the child dies, the request fails


class GrammarError(ValueError):
    """A regex or JSON schema that cannot be used for constrained decoding (bad syntax, too costly, ...)."""


class GrammarTimeoutError(GrammarError):
    """Compiling the grammar took longer than the backend's timeout."""


def check_regex_syntax(regex: str) -> None:
    """Fast pre-check (Python's parser). Escapes Python lacks (`\\p{L}`, `\\z`) are left to the real compiler."""
    if not isinstance(regex, str):
        raise GrammarError(f"a regex must be a string, got {type(regex).__name__}")
    if regex == "":
        raise GrammarError("the regex is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. FutureWarning for POSIX classes such as [[:alpha:]]
            re.compile(regex)
    except re.error as exc:
        if "bad escape" not in str(exc):
            raise GrammarError(f"invalid regex {_preview(regex)}: {exc}") from None
    except (RecursionError, OverflowError) as exc:
        raise GrammarError(f"invalid regex {_preview(regex)}: {type(exc).__name__}") from None


def build_index(regex: str, vocabulary) -> object:
    from outlines_core import Index

    if regex == "":
        raise GrammarError("the regex is empty")
    try:
        return Index(regex, vocabulary)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"cannot compile regex {_preview(regex)}: {_explain(regex, _first_line(exc))}") from None


def _explain(regex: str, message: str) -> str:
    """outlines-core drops the parser's detail from syntax errors; say something a user can act on."""
    if "error building NFA" in message:
        try:
            re.compile(regex)
        except re.error as exc:
            return f"invalid syntax: {exc}"
        except (RecursionError, OverflowError):
            pass
        return "syntax not supported here (look-arounds, backreferences and lazy or possessive tricks are not)"
    if "start state" in message:
        return "anchors and word boundaries (^, $, \\b) are not supported; the whole output always matches the regex"
    return message


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _preview(regex: str, limit: int = 80) -> str:
    return repr(regex if len(regex) <= limit else regex[:limit] + "...")


# The child loads this folder as a stand-alone package: no `braid` import (fast start, no torch); only
# strings and outlines-core objects cross the pipe.
_WORKER_BOOT = (
    "import sys, types; pkg = types.ModuleType('_grammar_worker'); pkg.__path__ = [sys.argv[1]]; "
    "sys.modules['_grammar_worker'] = pkg; from _grammar_worker.fsm import worker_main; worker_main(int(sys.argv[2]))"
)


def worker_main(fd: int) -> None:
    """Child process loop: receive the vocabulary once, then regexes; answer each with its index or an error."""
    conn = Connection(fd)
    _limit_memory(WORKER_MEMORY_LIMIT_BYTES)
    parent_pid = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    vocabulary = conn.recv()
    conn.send(("ready",))
    while True:
        try:
            regex = conn.recv()
        except EOFError:
            return
        if regex is None:
            return
        try:
            index = build_index(regex, vocabulary)
        except GrammarError as exc:
            conn.send(("error", str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the waiting request, the worker lives on
            conn.send(("error", f"cannot compile regex {_preview(regex)}: {_first_line(exc)}"))
            continue
        conn.send(("index", index))


def _limit_memory(limit: int) -> None:
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or hard > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):
        pass


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


class _Worker:
    """One child process and its end of the pipe; driven by exactly one dispatcher thread."""

    def __init__(self, vocabulary_payload):
        self._payload = vocabulary_payload
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None

    def ensure_started(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.stop()
        parent, child = Pipe(duplex=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, os.path.dirname(os.path.abspath(__file__)), str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.conn = parent
        parent.send(self._payload)
        if not parent.poll(WORKER_START_TIMEOUT_S):
            self.stop()
            raise GrammarError("the grammar compile worker did not start")
        parent.recv()

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.poll() is None:
            try:
                self.conn.send(None)
                self.proc.wait(timeout=2.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.stop()


@dataclass
class _Job:
    regex: str
    future: Future


class CompilePool:
    """Compiles regexes into outlines-core `Index`es on `num_workers` child processes; each job gets `timeout_s`."""

    def __init__(self, vocabulary, num_workers: int = 1, timeout_s: float = 10.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers = [_Worker(vocabulary) for _ in range(num_workers)]
        self._threads = [
            threading.Thread(target=self._dispatch, args=(w,), name=f"grammar-compile-{i}", daemon=True)
            for i, w in enumerate(self._workers)
        ]
        self._closed = False
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _stop_all, list(self._workers))

    def submit(self, regex: str) -> Future:
        if self._closed:
            raise RuntimeError("the grammar compile pool is shut down")
        future: Future = Future()
        self._jobs.put(_Job(regex, future))
        return future

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._finalizer()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarError("the grammar backend is shut down"))

    def _dispatch(self, worker: _Worker) -> None:
        try:
            worker.ensure_started()
        except (GrammarError, OSError):
            pass  # retried on the first job, whose future then carries the error
        while True:
            job = self._jobs.get()
            if job is None or self._closed:
                if job is not None and job.future.set_running_or_notify_cancel():
                    job.future.set_exception(GrammarError("the grammar backend is shut down"))
                worker.close()
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(self._run(worker, job.regex))
            except GrammarError as exc:
                job.future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - a broken worker must fail the request, not the thread
                worker.stop()
                job.future.set_exception(GrammarError(f"grammar compile worker failed: {_first_line(exc)}"))

    def _run(self, worker: _Worker, regex: str):
        worker.ensure_started()
        conn = worker.conn
        deadline = time.monotonic() + self.timeout_s
        conn.send(regex)
        reply = self._receive(worker, deadline)
        if reply is None:
            raise GrammarTimeoutError(
                f"compiling regex {_preview(regex)} took longer than {self.timeout_s:g}s (the grammar is too complex)"
            )
        if reply[0] == "error":
            raise GrammarError(reply[1])
        return reply[1]

    @staticmethod
    def _receive(worker: _Worker, deadline: float):
        """The next reply, or None (and the worker killed) when the deadline passes first."""
        conn = worker.conn
        try:
            if conn.poll(max(0.0, deadline - time.monotonic())):
                return conn.recv()
        except EOFError:
            worker.stop()
            raise GrammarError("the grammar compile worker died (out of memory?)") from None
        worker.stop()
        return None


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.stop()
        except OSError:
            pass

