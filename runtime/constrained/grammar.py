"""Grammar-constrained decoding: compiled grammars (shared, cached), per-request states, logit masks."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

import torch

from .fsm import (WORKER_START_TIMEOUT_S, CompilePool, GrammarBusyError, GrammarError, GrammarTimeoutError,
                  check_regex_syntax)
from .json_schema import json_schema_to_regex, schema_to_json_text
from .regex_classes import ascii_shorthand_classes
from .jump_forward import ForcedBytes, JumpForward, retokenize_candidates
from .vocabulary import TokenVocabulary, build_token_vocabulary

KINDS = ("regex", "json")


def default_grammar_workers() -> int:
    """min(4, CPUs), and at least 2 so one slow compile never leaves nobody for the next."""
    return max(2, min(4, os.cpu_count() or 1))


class _Cursor(NamedTuple):
    fsm_state: int
    terminated: bool


class _VocabTables:
    """Per-tokenizer lookups shared by every grammar of one backend."""

    def __init__(self, vocabulary: TokenVocabulary):
        self.vocabulary = vocabulary
        first = [raw[0] if raw else -1 for raw in vocabulary.token_bytes]
        self.first_byte = torch.tensor(first, dtype=torch.int16)  # [V]
        self.single_byte_token: list[int | None] = [None] * 256
        for token_id, raw in enumerate(vocabulary.token_bytes):
            if raw is not None and len(raw) == 1 and self.single_byte_token[raw[0]] is None:
                self.single_byte_token[raw[0]] = token_id


class CompiledGrammar:
    """One regex compiled against one vocabulary; immutable and shared by every request using it."""

    def __init__(self, kind: str, spec: str, regex: str, index, tables: _VocabTables, vocab_size: int, tokenizer):
        self.kind = kind
        self.spec = spec
        self.regex = regex
        self.index = index
        self.vocabulary = tables.vocabulary
        self.vocab_size = vocab_size
        self.eos_token_id = tables.vocabulary.eos_token_id
        self.tokenizer = tokenizer
        self.forced_bytes = ForcedBytes(index, self.allowed_ids, tables.first_byte, tables.single_byte_token)
        self._allowed_cpu: dict[int, torch.Tensor] = {}
        self._allowed_device: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()

    def new_state(self) -> "GrammarState":
        return GrammarState(self)

    def __repr__(self) -> str:
        return f"CompiledGrammar(kind={self.kind!r}, regex={self.regex[:60]!r})"

    def allowed_ids(self, fsm_state: int) -> torch.Tensor:
        """Sorted int64 ids allowed in `fsm_state` (EOS included when the state is final); cached per state."""
        ids = self._allowed_cpu.get(fsm_state)
        if ids is None:
            raw = self.index.get_allowed_tokens(fsm_state) or []
            allowed = {t for t in raw if t != self.eos_token_id}
            if self.index.is_final_state(fsm_state):
                allowed.add(self.eos_token_id)
            ids = torch.tensor(sorted(allowed), dtype=torch.int64)
            with self._lock:
                self._allowed_cpu[fsm_state] = ids
        return ids

    def allowed_ids_on(self, fsm_state: int, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.allowed_ids(fsm_state)
        key = (fsm_state, device)
        ids = self._allowed_device.get(key)
        if ids is None:
            ids = self.allowed_ids(fsm_state).to(device)
            with self._lock:
                self._allowed_device[key] = ids
        return ids

    def initial_cursor(self) -> _Cursor:
        return _Cursor(self.index.get_initial_state(), False)

    def advance(self, cursor: _Cursor, token_id: int) -> _Cursor | None:
        """The cursor after `token_id`, or None when the grammar does not allow it there."""
        if cursor.terminated:
            return None
        if token_id == self.eos_token_id:
            return _Cursor(cursor.fsm_state, True) if self.index.is_final_state(cursor.fsm_state) else None
        if not 0 <= token_id < self.vocab_size:
            return None
        next_state = self.index.get_next_state(cursor.fsm_state, token_id)
        return None if next_state is None else _Cursor(next_state, False)


class GrammarState:
    """One request's position in a compiled grammar, with the history needed to roll back."""

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self._cursor = grammar.initial_cursor()
        self._history: list[_Cursor] = []  # cursor before each accepted token
        self._tokens: list[int] = []

    @property
    def num_accepted(self) -> int:
        return len(self._tokens)

    def accept_token(self, token_id: int) -> None:
        token_id = int(token_id)
        nxt = self.grammar.advance(self._cursor, token_id)
        if nxt is None:
            if self._cursor.terminated:
                raise GrammarError(f"token {token_id} given after the grammar already terminated")
            raise GrammarError(f"token {token_id} is not allowed by the grammar here")
        self._history.append(self._cursor)
        self._tokens.append(token_id)
        self._cursor = nxt

    def rollback(self, n: int) -> None:
        if n < 0 or n > len(self._tokens):
            raise GrammarError(f"cannot roll back {n} tokens; {len(self._tokens)} were accepted")
        if n == 0:
            return
        self._cursor = self._history[-n]
        del self._history[-n:]
        del self._tokens[-n:]

    def is_terminated(self) -> bool:
        if self._cursor.terminated:
            return True
        return len(self.grammar.allowed_ids(self._cursor.fsm_state)) == 0

    def allowed_token_ids(self) -> torch.Tensor:
        """Sorted int64 ids, shared by every request in this state: read, never modify in place.

        Once terminated (or at a dead end) just EOS, so a masked row never becomes all -inf.
        """
        if self._cursor.terminated:
            return torch.tensor([self.grammar.eos_token_id], dtype=torch.int64)
        ids = self.grammar.allowed_ids(self._cursor.fsm_state)
        if len(ids) == 0:
            return torch.tensor([self.grammar.eos_token_id], dtype=torch.int64)
        return ids

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        """Overwrite `mask[row]` (mask: [B, vocab_size] bool) with this state's allowed tokens."""
        if self._cursor.terminated or len(self.grammar.allowed_ids(self._cursor.fsm_state)) == 0:
            ids = torch.tensor([self.grammar.eos_token_id], dtype=torch.int64, device=mask.device)
        else:
            ids = self.grammar.allowed_ids_on(self._cursor.fsm_state, mask.device)
        mask_row = mask[row]
        mask_row.fill_(False)
        mask_row.index_fill_(0, ids, True)

    def jump_forward(self, output_ids: list[int]) -> JumpForward | None:
        """Append the grammar's forced continuation without sampling, re-encoded with the last few tokens."""
        if self._cursor.terminated:
            return None
        forced = self.grammar.forced_bytes(self._cursor.fsm_state)
        if not forced:
            return None
        candidates = retokenize_candidates(self.grammar.tokenizer, self.grammar.vocabulary.token_bytes,
                                           self._tokens, output_ids, forced)
        for num_rollback, token_ids in candidates:
            if self._replay(num_rollback, token_ids):
                return JumpForward(num_rollback, token_ids)
        return None

    def _replay(self, num_rollback: int, token_ids: list[int]) -> bool:
        """Roll back and accept `token_ids`, all or nothing."""
        keep = len(self._tokens) - num_rollback
        cursor = self._history[keep] if num_rollback else self._cursor
        history, tokens = self._history[:keep], self._tokens[:keep]
        for token_id in token_ids:
            nxt = self.grammar.advance(cursor, token_id)
            if nxt is None:
                return False
            history.append(cursor)
            tokens.append(token_id)
            cursor = nxt
        self._history, self._tokens, self._cursor = history, tokens, cursor
        return True


def apply_vocab_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """logits: [B, V]; mask: [B, V] bool, True = allowed (rows without a grammar are all True)."""
    if logits.shape != mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and mask {tuple(mask.shape)} differ in shape")
    logits.masked_fill_(~mask, float("-inf"))


class GrammarBackend:
    """Compiles and caches grammars for one tokenizer; `vocab_size` is the model's logits width.

    Compiles run in a pool of worker processes (`num_workers`, 0 or None: `default_grammar_workers()`);
    at most `max_queued` wait for a worker, more fail at once. Compiled grammars (and compile errors) are
    kept in an LRU of `cache_size` entries keyed by (kind, spec); a timeout is remembered for
    `timeout_retry_after_s`, so a repeated pathological regex fails at once instead of taking a worker again.
    """

    def __init__(self, tokenizer, vocab_size: int, whitespace_pattern: str | None = None, timeout_s: float = 10.0,
                 num_workers: int | None = None, *, eos_token_id: int | None = None, cache_size: int = 512,
                 max_queued: int = 32, timeout_retry_after_s: float = 60.0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.whitespace_pattern = whitespace_pattern
        self.timeout_s = timeout_s
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.cache_size = cache_size
        self.timeout_retry_after_s = timeout_retry_after_s
        num_workers = num_workers or default_grammar_workers()
        full = build_token_vocabulary(tokenizer, eos_token_id)
        if not 0 <= full.eos_token_id < vocab_size:
            raise ValueError(f"EOS token id {full.eos_token_id} is outside the model's vocabulary ({vocab_size})")
        # Tokens the model cannot emit (id >= vocab_size) are never allowed.
        self.vocabulary = TokenVocabulary(full.token_bytes[:vocab_size], full.eos_token_id)
        self._tables = _VocabTables(self.vocabulary)
        self.eos_token_id = self.vocabulary.eos_token_id
        self._pool = CompilePool(self.vocabulary.to_outlines(), num_workers=num_workers, timeout_s=timeout_s,
                                 max_queued=max_queued)
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._timed_out_at: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._counts = collections.Counter()

    @property
    def pool(self) -> CompilePool:
        return self._pool

    def stats(self) -> dict[str, int]:
        """Counters: cache_hits, cache_misses, cached (entries now) and the pool's (compiles, timeouts, rejected,
        restarts, spares_started, errors)."""
        out = dict.fromkeys(("cache_hits", "cache_misses", "compiles", "timeouts", "errors", "rejected", "restarts",
                             "spares_started"), 0)
        with self._lock:
            out.update(self._counts)
            out["cached"] = len(self._cache)
        out.update(self._pool.stats)
        return out

    def validate(self, kind: str, spec) -> None:
        self._to_regex(kind, spec)

    def would_compile(self, kind: str, spec) -> bool:
        """Whether submitting (kind, spec) now starts a compile (no cached or in-flight entry serves it)."""
        try:
            key = self._cache_key(kind, spec)
        except GrammarError:
            return False
        with self._lock:
            return key not in self._cache or self._timeout_passed_locked(key)

    def submit(self, kind: str, spec) -> concurrent.futures.Future:
        """Future of a `CompiledGrammar`; the same (kind, spec) gives the same future (and object)."""
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
            self._counts["cache_misses"] += 1
            self._cache[key] = outer
            self._evict_locked()
        try:
            regex = self._to_regex(kind, key[1])
            inner = self._pool.submit(regex)
        except (GrammarError, RuntimeError) as exc:
            self._set_exception(key, outer, exc if isinstance(exc, GrammarError) else GrammarError(str(exc)))
            return outer
        inner.add_done_callback(lambda done: self._finish(key, regex, outer, done))
        return outer

    def compile(self, kind: str, spec) -> CompiledGrammar:
        future = self.submit(kind, spec)
        try:
            return future.result(timeout=self.timeout_s * 4 + WORKER_START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise GrammarTimeoutError(f"compiling the {kind} grammar did not finish in time") from None

    def shutdown(self) -> None:
        self._pool.shutdown()

    def _cache_key(self, kind: str, spec) -> tuple[str, str]:
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")
        if kind == "json" and not isinstance(spec, str):
            spec = schema_to_json_text(spec)
        if not isinstance(spec, str):
            raise GrammarError(f"a {kind} grammar must be given as a string, got {type(spec).__name__}")
        return kind, spec

    def _to_regex(self, kind: str, spec) -> str:
        kind, spec = self._cache_key(kind, spec)
        if kind == "regex":
            check_regex_syntax(spec)
            return ascii_shorthand_classes(spec)
        return ascii_shorthand_classes(json_schema_to_regex(spec, self.whitespace_pattern))

    def _finish(self, key, regex: str, outer: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
        exc = done.exception()
        if exc is not None:
            self._set_exception(key, outer, exc if isinstance(exc, GrammarError) else GrammarError(str(exc)))
            return
        try:
            grammar = CompiledGrammar(key[0], key[1], regex, done.result(), self._tables, self.vocab_size,
                                      self.tokenizer)
            grammar.allowed_ids(grammar.initial_cursor().fsm_state)  # here, off the scheduler's thread
        except Exception as exc:  # noqa: BLE001 - the waiting request must end either way
            self._set_exception(key, outer, GrammarError(f"cannot use the compiled grammar: {exc}"))
            return
        try:
            outer.set_result(grammar)
        except concurrent.futures.InvalidStateError:
            self._forget(key, outer)  # a caller cancelled the shared future

    def _set_exception(self, key, outer: concurrent.futures.Future, exc: GrammarError) -> None:
        if isinstance(exc, GrammarBusyError) or "shut down" in str(exc):
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
