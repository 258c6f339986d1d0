"""Regex compiles (regex_index.build_index) in worker processes: `CompilePool`.

A regex can blow up into an exponential DFA (`(a|b)*a(a|b){25}`), and outlines-core has no size limit.
A thread running that could never be stopped, so compiles run in child processes: past the timeout
the child is killed, the waiting future fails, and a fresh child replaces it at once.

The pool keeps `num_workers` children ready for new compiles. A compile still running after
`slow_after_s` no longer counts as ready: a spare child starts in its place (up to `max_workers`), so a
few pathological regexes cannot hold back a trivial one. Compiles waiting for a child are capped;
past the cap `submit` fails at once (`GrammarBusyError`).

Importable without torch (the child imports this module).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import Union

import msgspec

from .grammar_errors import GrammarBusyError, GrammarError, GrammarShutDownError, GrammarTimeoutError
from .regex_index import build_index, first_line, preview_regex

WORKER_START_TIMEOUT_S = 120.0
WORKER_MEMORY_LIMIT_BYTES = 8 << 30  # address space of a compile child; past it the child dies, the request fails


# The child loads this folder as a stand-alone package: no `braid` import (fast start, no torch). Nothing on the
# pipe is pickled: the parent sends the vocabulary once in outlines-core's own binary form, then each regex as UTF-8
# bytes (an empty frame asks the child to exit); the child answers with msgpack-encoded `_WorkerReply` frames, a
# compiled Index again in outlines-core's binary form.
WORKER_NICENESS = 10


class _WorkerReady(msgspec.Struct, tag=True):
    pass


class _Compiled(msgspec.Struct, tag=True):
    index: bytes  # outlines_core.Index in its binary form (Index.from_binary)


class _CompileFailed(msgspec.Struct, tag=True):
    message: str


_WorkerReply = Union[_WorkerReady, _Compiled, _CompileFailed]
_reply_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(_WorkerReply)


def outlines_binary(obj) -> bytes:
    """An outlines-core Vocabulary or Index as the bytes its `from_binary` reads back (the library exposes this
    form only as the argument of its `__reduce__`, which names `from_binary` as the constructor)."""
    constructor, args = obj.__reduce__()
    if getattr(constructor, "__name__", None) != "from_binary" or not isinstance(args[0], bytes):
        raise TypeError(f"{type(obj).__name__} has no binary form this version of braid knows")
    return args[0]


def _reply(conn: Connection, reply: msgspec.Struct) -> None:
    conn.send_bytes(_reply_encoder.encode(reply))
_WORKER_BOOT = (
    "import sys, types; pkg = types.ModuleType('_grammar_worker'); pkg.__path__ = [sys.argv[1]]; "
    "sys.modules['_grammar_worker'] = pkg; from _grammar_worker.compile_pool import worker_main; worker_main(int(sys.argv[2]))"
)


def worker_main(fd: int) -> None:
    """Child process loop: receive the vocabulary once, then regexes; answer each with its index or an error."""
    conn = Connection(fd)
    _limit_memory(WORKER_MEMORY_LIMIT_BYTES)
    os.nice(WORKER_NICENESS)  # a compile that runs to its timeout must not take CPU from the scheduler and HTTP loop
    parent_pid = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    from outlines_core import Vocabulary

    vocabulary = Vocabulary.from_binary(conn.recv_bytes())
    _reply(conn, _WorkerReady())
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        if not data:  # the parent's request to exit
            return
        regex = data.decode("utf-8")
        try:
            index = outlines_binary(build_index(regex, vocabulary))
        except GrammarError as exc:
            _reply(conn, _CompileFailed(str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the waiting request, the worker lives on
            _reply(conn, _CompileFailed(f"cannot compile regex {preview_regex(regex)}: {first_line(exc)}"))
            continue
        _reply(conn, _Compiled(index))


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
    """One child process and its end of the pipe; driven by exactly one pool thread."""

    def __init__(self, vocabulary_payload: bytes):
        self._payload = vocabulary_payload  # outlines_binary(vocabulary)
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_started(self) -> None:
        if self.alive:
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
        parent.send_bytes(self._payload)
        if not parent.poll(WORKER_START_TIMEOUT_S):
            self.stop()
            raise GrammarError("the grammar compile worker did not start")
        if not isinstance(_reply_decoder.decode(parent.recv_bytes()), _WorkerReady):
            self.stop()
            raise GrammarError("the grammar compile worker answered its start-up with something else")

    def kill(self) -> None:
        """Safe from any thread: the owning thread sees EOF on its pipe and cleans up."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()

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
        if self.conn is not None and self.alive:
            try:
                self.conn.send_bytes(b"")
                self.proc.wait(timeout=2.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.stop()


@dataclass
class _Job:
    regex_bytes: bytes
    future: Future


class _Slot:
    """A worker with the thread that feeds it; `busy_since` is when its current compile began (None: idle)."""

    def __init__(self, worker: _Worker):
        self.worker = worker
        self.busy_since: float | None = None
        self.retired = False
        self.thread: threading.Thread | None = None

    def is_slow(self, now: float, slow_after_s: float) -> bool:
        return self.busy_since is not None and now - self.busy_since >= slow_after_s


class CompilePool:
    """Compiles regexes into outlines-core `Index`es in child processes; each compile gets `timeout_s`.

    `num_workers` children stay ready for new compiles; each compile running longer than `slow_after_s`
    gets a spare child started beside it, up to `max_workers` children in all. At most `max_queued`
    compiles wait for a child; `submit` fails beyond that.
    """

    IDLE_RETIRE_S = 5.0

    def __init__(self, vocabulary, num_workers: int = 2, timeout_s: float = 10.0, *, max_workers: int | None = None,
                 max_queued: int = 32, slow_after_s: float | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        max_workers = 2 * num_workers if max_workers is None else max_workers
        if max_workers < num_workers:
            raise ValueError(f"max_workers ({max_workers}) must be >= num_workers ({num_workers})")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.max_workers = max_workers
        self.max_queued = max_queued
        self.slow_after_s = min(0.1, timeout_s / 4) if slow_after_s is None else slow_after_s
        # Every key present from the start, so a reader copying it never sees the dict change size.
        self.stats = collections.Counter(dict.fromkeys(
            ("compiles", "timeouts", "errors", "rejected", "restarts", "spares_started"), 0))
        self._vocabulary = outlines_binary(vocabulary)
        self._cond = threading.Condition()
        self._pending: collections.deque[_Job] = collections.deque()
        self._slots: list[_Slot] = []
        self._every_worker: list[_Worker] = []  # for the finalizer: also workers whose thread is still retiring
        self._closed = False
        with self._cond:
            for _ in range(num_workers):
                self._add_slot_locked()
        self._supervisor = threading.Thread(target=self._supervise, name="grammar-compile-supervisor", daemon=True)
        self._supervisor.start()
        self._finalizer = weakref.finalize(self, _stop_all, self._every_worker)

    # ---- public ----

    def submit(self, regex: str) -> Future:
        try:
            regex_bytes = regex.encode("utf-8")
        except UnicodeEncodeError:
            raise GrammarError(f"regex {preview_regex(regex)} is not valid UTF-8 text") from None
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile pool is shut down")
            if len(self._pending) >= self.max_queued:
                self.stats["rejected"] += 1
                raise GrammarBusyError(f"the grammar compiler is busy ({len(self._pending)} compiles waiting, the "
                                       f"limit); try again later")
            self._pending.append(_Job(regex_bytes, future))
            self._cond.notify_all()  # notify() could wake only the supervisor, which waits on the same condition
        return future

    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes."""
        with self._cond:
            workers = [slot.worker for slot in self._slots]
        return [w.proc.pid for w in workers if w.proc is not None and w.proc.poll() is None]

    def num_queued(self) -> int:
        with self._cond:
            return len(self._pending)

    def shutdown(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            busy = [slot.worker for slot in self._slots if slot.busy_since is not None]
            threads = [slot.thread for slot in self._slots]
            pending = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for worker in busy:  # a compile in progress is abandoned, not waited for
            worker.kill()
        for job in pending:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarShutDownError("the grammar backend is shut down"))
        self._supervisor.join(timeout=5.0)
        for thread in threads:
            if thread is not None:
                thread.join(timeout=5.0)
        self._finalizer()

    # ---- threads ----

    def _add_slot_locked(self) -> _Slot:
        worker = _Worker(self._vocabulary)
        slot = _Slot(worker)
        slot.thread = threading.Thread(target=self._serve, args=(slot,), daemon=True,
                                       name=f"grammar-compile-{len(self._every_worker)}")
        self._slots.append(slot)
        self._every_worker.append(worker)
        slot.thread.start()
        return slot

    def _ready_count_locked(self, now: float, excluding: _Slot | None = None) -> int:
        return sum(1 for s in self._slots if s is not excluding and not s.is_slow(now, self.slow_after_s))

    def _supervise(self) -> None:
        tick = max(0.01, self.slow_after_s / 5)
        with self._cond:
            while not self._closed:
                self._cond.wait(timeout=tick)
                if self._closed:
                    return
                missing = self.num_workers - self._ready_count_locked(time.monotonic())
                for _ in range(min(missing, self.max_workers - len(self._slots))):
                    self._add_slot_locked()
                    self.stats["spares_started"] += 1

    def _may_retire_locked(self, slot: _Slot) -> bool:
        """A spare leaves once enough other workers are ready without it."""
        return len(self._slots) > self.num_workers and \
            self._ready_count_locked(time.monotonic(), excluding=slot) >= self.num_workers

    def _retire_locked(self, slot: _Slot) -> None:
        slot.retired = True
        self._slots.remove(slot)

    def _serve(self, slot: _Slot) -> None:
        worker = slot.worker
        try:
            worker.ensure_started()
        except (GrammarError, OSError):
            pass  # retried on the first job, whose future then carries the error
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    if not self._cond.wait(timeout=self.IDLE_RETIRE_S) and self._may_retire_locked(slot):
                        self._retire_locked(slot)
                        break
                if self._closed or slot.retired:
                    break
                job = self._pending.popleft()
                slot.busy_since = time.monotonic()
            try:
                if job.future.set_running_or_notify_cancel():
                    self._compile(worker, job)
            finally:
                with self._cond:
                    slot.busy_since = None
                    closed = self._closed
                    if not closed and self._may_retire_locked(slot):
                        self._retire_locked(slot)
            if closed or slot.retired:
                break
            if not worker.alive:  # killed on timeout or died: replace it now, not on the next job
                try:
                    worker.ensure_started()
                    self.stats["restarts"] += 1
                except (GrammarError, OSError):
                    pass
        worker.close()
        with self._cond:
            if worker in self._every_worker:
                self._every_worker.remove(worker)

    def _compile(self, worker: _Worker, job: _Job) -> None:
        self.stats["compiles"] += 1
        try:
            job.future.set_result(self._run(worker, job.regex_bytes))
        except GrammarError as exc:
            if self._closed:
                exc = GrammarShutDownError("the grammar backend is shut down")
            self.stats["timeouts" if isinstance(exc, GrammarTimeoutError) else "errors"] += 1
            job.future.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - a broken worker must fail the request, not the thread
            worker.stop()
            self.stats["errors"] += 1
            job.future.set_exception(GrammarError(f"grammar compile worker failed: {first_line(exc)}"))

    def _run(self, worker: _Worker, regex_bytes: bytes):
        worker.ensure_started()
        deadline = time.monotonic() + self.timeout_s
        worker.conn.send_bytes(regex_bytes)
        reply = self._receive(worker, deadline)
        if reply is None:
            regex = regex_bytes.decode("utf-8")
            raise GrammarTimeoutError(
                f"compiling regex {preview_regex(regex)} took longer than {self.timeout_s:g}s (the grammar is too complex)"
            )
        if isinstance(reply, _CompileFailed):
            raise GrammarError(reply.message)
        if not isinstance(reply, _Compiled):
            raise GrammarError(f"the grammar compile worker sent {type(reply).__name__} instead of a compiled grammar")
        from outlines_core import Index

        return Index.from_binary(reply.index)

    @staticmethod
    def _receive(worker: _Worker, deadline: float):
        """The next reply, or None (and the worker killed) when the deadline passes first."""
        conn = worker.conn
        try:
            if conn.poll(max(0.0, deadline - time.monotonic())):
                return _reply_decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            worker.stop()
            raise GrammarError("the grammar compile worker died (out of memory?)") from None
        worker.stop()
        return None


def _stop_all(workers: list[_Worker]) -> None:
    for worker in list(workers):
        try:
            worker.stop()
        except OSError:
            pass
