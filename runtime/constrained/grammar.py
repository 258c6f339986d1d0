"""The grammar backend: one engine (llguidance or outlines-core) behind one interface, a cache of compiled grammars,
compiles shared fairly between clients, and batched bitmask fills.

Engines (`engine=`): "llguidance" (regex, JSON schema, Lark / GBNF grammars, structural tags), "outlines" (regex and
JSON schema through braid's schema -> regex translation), "auto" (llguidance; a regex or schema it refuses goes to
outlines-core). A grammar's states share one interface: accept_token, rollback, is_terminated, is_accepting,
fill_bitmask(bitmask, row), jump_forward(output_ids), num_accepted.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from collections import OrderedDict

import torch

from .compile_pool import WORKER_START_TIMEOUT_S
from .grammar_errors import GrammarBusyError, GrammarError, GrammarShutDownError, GrammarTimeoutError
from .json_schema import schema_to_json_text
from .vocabulary import TokenVocabulary, build_token_vocabulary

KINDS = ("regex", "json", "grammar", "structural_tag")
ENGINES = ("llguidance", "outlines", "auto")


def default_grammar_workers() -> int:
    """min(4, CPUs), and at least 2 so one slow compile never leaves nobody for the next."""
    return max(2, min(4, os.cpu_count() or 1))


class _Queued:
    """A compile waiting for its turn: the shared future its requests hold, and the client it counts against."""

    __slots__ = ("key", "future", "client")

    def __init__(self, key, future, client: str):
        self.key = key
        self.future = future
        self.client = client


class GrammarBackend:
    """Compiles and caches grammars for one tokenizer; `vocab_size` is the model's logits width.

    Compiles run on the engine's workers (threads for llguidance, processes for outlines-core), at most
    `2 * num_workers` at once and one fewer of one client's, so a client's slow grammars never hold every worker;
    the rest wait in one queue per client, served in turn, so one client's burst of new schemas delays another
    client's compile by at most one of its own. At most `max_queued` compiles wait in all and
    `max_queued_per_client` (0: no cap) per client; past either, `submit` fails with GrammarBusyError (the server's
    429). Compiled grammars and compile errors are kept in an LRU of `cache_size` entries keyed by
    (kind, spec); a timeout is remembered for `timeout_retry_after_s`, so a pathological grammar fails at once.
    `json_strict` (llguidance): an object schema silent on extra properties allows none (XGrammar's strict mode, as
    in SGLang and vLLM; outlines-core's translation always does so); off, it allows them as the specification reads.
    """

    def __init__(self, tokenizer, vocab_size: int, whitespace_pattern: str | None = None, timeout_s: float = 10.0,
                 num_workers: int | None = None, *, engine: str = "llguidance", eos_token_id: int | None = None,
                 cache_size: int = 512, max_queued: int = 1024, max_queued_per_client: int = 0,
                 timeout_retry_after_s: float = 60.0, json_strict: bool = True):
        if engine not in ENGINES:
            raise ValueError(f"unknown grammar engine {engine!r}; expected one of {', '.join(ENGINES)}")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.whitespace_pattern = whitespace_pattern
        self.timeout_s = timeout_s
        self.engine_name = engine
        self.json_strict = json_strict
        self.cache_size = cache_size
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        self.timeout_retry_after_s = timeout_retry_after_s
        self.num_workers = num_workers or default_grammar_workers()
        self.max_in_flight = 2 * self.num_workers
        self.max_in_flight_per_client = max(1, self.max_in_flight - 1)
        full = build_token_vocabulary(tokenizer, eos_token_id)
        if not 0 <= full.eos_token_id < vocab_size:
            raise ValueError(f"EOS token id {full.eos_token_id} is outside the model's vocabulary ({vocab_size})")
        # Tokens the model cannot emit (id >= vocab_size) are never allowed.
        self.vocabulary = TokenVocabulary(full.token_bytes[:vocab_size], full.eos_token_id)
        self.eos_token_id = self.vocabulary.eos_token_id
        self._primary = self._engine("outlines" if engine == "outlines" else "llguidance")
        self._fallback = None  # outlines-core under "auto", started on the first refusal
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._timed_out_at: dict[tuple[str, str], float] = {}
        self._waiting: OrderedDict[str, collections.deque[_Queued]] = OrderedDict()  # client -> its compiles
        self._num_waiting = 0
        self._in_flight = 0
        self._client_in_flight: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._counts = collections.Counter()

    # ---- engines ----
    def _engine(self, name: str):
        if name == "llguidance":
            from .llguidance_engine import LLGuidanceEngine

            return LLGuidanceEngine(self.tokenizer, self.vocabulary, self.vocab_size,
                                    whitespace_pattern=self.whitespace_pattern, timeout_s=self.timeout_s,
                                    num_workers=self.num_workers, json_strict=self.json_strict)
        from .outlines_engine import OutlinesEngine

        return OutlinesEngine(self.tokenizer, self.vocabulary, self.vocab_size,
                              whitespace_pattern=self.whitespace_pattern, timeout_s=self.timeout_s,
                              num_workers=self.num_workers, max_queued=self.max_in_flight)

    def _fallback_engine(self, kind: str):
        if self.engine_name != "auto" or kind not in ("regex", "json"):
            return None
        with self._lock:
            if self._fallback is None:
                self._fallback = self._engine("outlines")
            return self._fallback

    @property
    def pool(self):
        """The outlines-core compile pool (engine "outlines"), for tests and stats."""
        return getattr(self._primary, "pool", None)

    def stats(self) -> dict[str, int]:
        """Counters: cache_hits, cache_misses, cached (entries now), waiting, in_flight, rejected, fallbacks, and
        the engines' (compiles, timeouts, errors, ...)."""
        out = dict.fromkeys(("cache_hits", "cache_misses", "compiles", "timeouts", "errors", "rejected",
                             "fallbacks"), 0)
        with self._lock:
            out.update(self._counts)
            out["cached"] = len(self._cache)
            out["waiting"] = self._num_waiting
            out["in_flight"] = self._in_flight
        engines = [self._primary] + ([self._fallback] if self._fallback is not None else [])
        for engine in engines:
            for k, v in engine.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    # ---- compiling ----
    def validate(self, kind: str, spec) -> None:
        """The errors found without compiling (syntax, a schema's unsupported keywords): GrammarError. A spec the
        cache holds is not checked again (its compile, or its error, answers the request)."""
        kind, spec = self._cache_key(kind, spec)
        with self._lock:
            if (kind, spec) in self._cache:
                return
        try:
            self._primary.check(kind, spec)
        except GrammarError:
            fallback = self._fallback_engine(kind)
            if fallback is None:
                raise
            fallback.check(kind, spec)

    def submit(self, kind: str, spec, client: str = "") -> concurrent.futures.Future:
        """Future of a compiled grammar; the same (kind, spec) gives the same future (and object). `client` names
        whose queue a new compile waits in."""
        outer: concurrent.futures.Future = concurrent.futures.Future()
        try:
            key = self._cache_key(kind, spec)
        except GrammarError as exc:
            outer.set_exception(exc)
            return outer
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and self._timeout_expired_locked(key):
                del self._cache[key]
                cached = None
            if cached is not None:
                self._cache.move_to_end(key)
                self._counts["cache_hits"] += 1
                return cached
            queue = self._waiting.get(client)
            can_start = (self._in_flight < self.max_in_flight
                         and self._client_in_flight[client] < self.max_in_flight_per_client)
            waiting = len(queue) if queue is not None else 0
            if not can_start and (self._num_waiting >= self.max_queued
                                  or (self.max_queued_per_client and waiting >= self.max_queued_per_client)):
                self._counts["rejected"] += 1
                outer.set_exception(GrammarBusyError(
                    f"the grammar compiler is busy ({self._num_waiting} compiles waiting, {waiting} of them this "
                    f"client's; the caps are --grammar-max-queued and --grammar-max-queued-per-client); try again "
                    f"later"))
                return outer
            self._counts["cache_misses"] += 1
            self._cache[key] = outer
            self._evict_locked()
            queued = _Queued(key, outer, client)
            if can_start:
                self._in_flight += 1
                self._client_in_flight[client] += 1
                start = queued
            else:
                self._waiting.setdefault(client, collections.deque()).append(queued)
                self._num_waiting += 1
                start = None
        if start is not None:
            self._start(start)
        return outer

    def compile(self, kind: str, spec) -> object:
        future = self.submit(kind, spec)
        try:
            return future.result(timeout=self.timeout_s * 4 + WORKER_START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise GrammarTimeoutError(f"compiling the {kind} grammar did not finish in time") from None

    def shutdown(self) -> None:
        with self._lock:
            waiting = [q for queue in self._waiting.values() for q in queue]
            self._waiting.clear()
            self._num_waiting = 0
        for queued in waiting:
            self._set_exception(queued.key, queued.future, GrammarShutDownError("the grammar backend is shut down"))
        self._primary.shutdown()
        if self._fallback is not None:
            self._fallback.shutdown()

    def _start(self, queued: _Queued, engine=None) -> None:
        kind, spec = queued.key
        engine = engine or self._primary
        try:
            inner = engine.submit(kind, spec)
        except GrammarError as exc:
            inner = concurrent.futures.Future()
            inner.set_exception(exc)
        inner.add_done_callback(lambda done: self._finish(queued, engine, done))

    def _finish(self, queued: _Queued, engine, done: concurrent.futures.Future) -> None:
        exc = done.exception()
        if exc is not None and not isinstance(exc, (GrammarTimeoutError, GrammarBusyError)) \
                and engine is self._primary:
            fallback = self._fallback_engine(queued.key[0])
            if fallback is not None:
                with self._lock:
                    self._counts["fallbacks"] += 1
                self._start(queued, fallback)
                return
        if exc is None:
            try:
                queued.future.set_result(done.result())
            except concurrent.futures.InvalidStateError:
                self._forget(queued.key, queued.future)  # a caller cancelled the shared future
        else:
            self._set_exception(queued.key, queued.future,
                                exc if isinstance(exc, GrammarError) else GrammarError(str(exc)))
        self._next(queued)

    def _next(self, done: _Queued) -> None:
        """A compile ended: start the next waiting one, from the first client in turn with a worker to spare."""
        with self._lock:
            self._in_flight -= 1
            self._client_in_flight[done.client] -= 1
            if not self._client_in_flight[done.client]:
                del self._client_in_flight[done.client]
            client = next((c for c in self._waiting if self._client_in_flight[c] < self.max_in_flight_per_client), None)
            if client is None:
                return
            queue = self._waiting.pop(client)
            queued = queue.popleft()
            self._num_waiting -= 1
            if queue:
                self._waiting[client] = queue  # to the back of the round
            self._in_flight += 1
            self._client_in_flight[client] += 1
        self._start(queued)

    def _cache_key(self, kind: str, spec) -> tuple[str, str]:
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")
        if kind in ("json", "structural_tag") and not isinstance(spec, str):
            spec = schema_to_json_text(spec)
        if not isinstance(spec, str):
            raise GrammarError(f"a {kind} grammar must be given as a string, got {type(spec).__name__}")
        return kind, spec

    def _set_exception(self, key, outer: concurrent.futures.Future, exc: GrammarError) -> None:
        if isinstance(exc, (GrammarBusyError, GrammarShutDownError)):
            self._forget(key, outer)  # not the grammar's fault: the next request compiles it
        elif isinstance(exc, GrammarTimeoutError):
            with self._lock:  # retried after a while (the timeout may have come from load, not the grammar)
                self._timed_out_at[key] = time.monotonic()
        try:
            outer.set_exception(exc)
        except concurrent.futures.InvalidStateError:
            self._forget(key, outer)

    def _forget(self, key, outer) -> None:
        with self._lock:
            if self._cache.get(key) is outer:
                del self._cache[key]
                self._timed_out_at.pop(key, None)

    def _timeout_passed_locked(self, key) -> bool:
        """Whether `key` timed out more than timeout_retry_after_s ago (a new submit compiles it again)."""
        timed_out_at = self._timed_out_at.get(key)
        return timed_out_at is not None and time.monotonic() - timed_out_at >= self.timeout_retry_after_s

    def _timeout_expired_locked(self, key) -> bool:
        if not self._timeout_passed_locked(key):
            return False
        del self._timed_out_at[key]
        return True

    def _evict_locked(self) -> None:
        """Drop the least recently used finished entries; compiles in flight stay (their number is capped)."""
        excess = len(self._cache) - self.cache_size
        if excess <= 0:
            return
        for key in [k for k, fut in self._cache.items() if fut.done()][:excess]:
            del self._cache[key]
            self._timed_out_at.pop(key, None)


def fill_bitmasks(states: list, bitmask: torch.Tensor) -> None:
    """bitmask[i] = states[i]'s allowed tokens for every i whose state is not None (bitmask: [B, words] int32,
    contiguous, CPU; other rows untouched). llguidance states of a batch are filled in parallel, but for those in
    their grammar's start state (an extend's new requests): a copy of the mask the compile computed."""
    parallel: dict[int, tuple[object, list]] = {}
    rows_np = None  # numpy's row assignment: a few microseconds where torch's copy_ costs several times that
    for row, state in enumerate(states):
        if state is None:
            continue
        engine = getattr(state.grammar, "engine", None)
        if engine != "llguidance":
            state.fill_bitmask(bitmask, row)
        elif state.at_start():
            if rows_np is None:
                rows_np = bitmask.numpy()
            rows_np[row] = state.grammar.start_mask_np
        else:
            parallel.setdefault(id(state.grammar.executor), (state.grammar.executor, []))[1].append(
                (state.matcher, row))
    for executor, rows in parallel.values():
        executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def accept_tokens(states: list, tokens: list[int]) -> list[bool]:
    """states[i].accept_token(tokens[i]) for every i; whether each token was accepted (a refused one leaves an
    llguidance state in its error state). llguidance states of a batch advance in parallel."""
    ok = [True] * len(states)
    parallel: dict[int, tuple[object, list, list]] = {}
    for i, (state, token) in enumerate(zip(states, tokens)):
        grammar = state.grammar
        if getattr(grammar, "engine", None) == "llguidance" and not state.terminated \
                and token != grammar.eos_token_id and 0 <= token < grammar.vocab_size:
            executor, rows, pairs = parallel.setdefault(id(grammar.executor), (grammar.executor, [], []))
            rows.append(i)
            pairs.append((state.matcher, token))
            continue
        try:
            state.accept_token(token)
        except GrammarError:
            ok[i] = False
    for executor, rows, pairs in parallel.values():
        for i, accepted in zip(rows, executor.consume_token_par(pairs)):
            if accepted:
                states[i].num_accepted += 1
            else:
                ok[i] = False
    return ok
