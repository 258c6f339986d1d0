"""The outlines-core engine: a regex (or a JSON schema turned into one) compiled into a token-level automaton in
worker processes (compile_pool.CompilePool); masks are per-state rows cached on the grammar."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import NamedTuple

import torch

from .bitmask import ids_to_bitmask_row
from .compile_pool import CompilePool
from .grammar_errors import GrammarError, GrammarShutDownError
from .regex_index import check_regex_syntax
from .json_schema import json_schema_to_regex
from .jump_forward import ForcedBytes, JumpForward, retokenize_candidates
from .regex_classes import ascii_shorthand_classes
from .schema_prepare import prepare_schema
from .vocabulary import TokenVocabulary


class _Cursor(NamedTuple):
    fsm_state: int
    terminated: bool


class _VocabTables:
    """Per-tokenizer lookups shared by every grammar of one engine."""

    def __init__(self, vocabulary: TokenVocabulary):
        self.vocabulary = vocabulary
        first = [raw[0] if raw else -1 for raw in vocabulary.token_bytes]
        self.first_byte = torch.tensor(first, dtype=torch.int16)  # [V]
        self.single_byte_token: list[int | None] = [None] * 256
        for token_id, raw in enumerate(vocabulary.token_bytes):
            if raw is not None and len(raw) == 1 and self.single_byte_token[raw[0]] is None:
                self.single_byte_token[raw[0]] = token_id


class OutlinesGrammar:
    """One regex compiled against one vocabulary; immutable and shared by every request using it."""

    engine = "outlines"

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
        self._allowed: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def new_state(self) -> "OutlinesState":
        return OutlinesState(self)

    def __repr__(self) -> str:
        return f"OutlinesGrammar(kind={self.kind!r}, regex={self.regex[:60]!r})"

    def allowed_ids(self, fsm_state: int) -> torch.Tensor:
        """Sorted int64 ids allowed in `fsm_state` (EOS included when the state is final); cached per state."""
        ids = self._allowed.get(fsm_state)
        if ids is None:
            raw = self.index.get_allowed_tokens(fsm_state) or []
            allowed = {t for t in raw if t != self.eos_token_id}
            if self.index.is_final_state(fsm_state):
                allowed.add(self.eos_token_id)
            ids = torch.tensor(sorted(allowed), dtype=torch.int64)
            with self._lock:
                self._allowed[fsm_state] = ids
        return ids

    def bitmask_row(self, fsm_state: int) -> torch.Tensor:
        """[words] int32 of `allowed_ids(fsm_state)` (EOS alone at a dead end); cached per state."""
        row = self._rows.get(fsm_state)
        if row is None:
            ids = self.allowed_ids(fsm_state)
            row = ids_to_bitmask_row(ids if len(ids) else [self.eos_token_id], self.vocab_size)
            with self._lock:
                self._rows[fsm_state] = row
        return row

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


class OutlinesState:
    """One request's position in a compiled grammar, with the history needed to roll back."""

    def __init__(self, grammar: OutlinesGrammar):
        self.grammar = grammar
        self._cursor = grammar.initial_cursor()
        self._history: list[_Cursor] = []  # cursor before each accepted token
        self._tokens: list[int] = []
        self._eos_row: torch.Tensor | None = None

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

    def is_accepting(self) -> bool:
        return not self._cursor.terminated and self.grammar.index.is_final_state(self._cursor.fsm_state)

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

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Overwrite `bitmask[row]` ([B, words] int32) with this state's allowed tokens."""
        if self._cursor.terminated:
            if self._eos_row is None:
                self._eos_row = ids_to_bitmask_row([self.grammar.eos_token_id], self.grammar.vocab_size)
            bitmask[row].copy_(self._eos_row)
        else:
            bitmask[row].copy_(self.grammar.bitmask_row(self._cursor.fsm_state))

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


class OutlinesEngine:
    """Regex and JSON schema (through braid's schema -> regex translation) on outlines-core."""

    name = "outlines"
    kinds = ("regex", "json")

    def __init__(self, tokenizer, vocabulary: TokenVocabulary, vocab_size: int, *, whitespace_pattern: str | None,
                 timeout_s: float, num_workers: int, max_queued: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.whitespace_pattern = whitespace_pattern
        self._tables = _VocabTables(vocabulary)
        self.pool = CompilePool(vocabulary.to_outlines(), num_workers=num_workers, timeout_s=timeout_s,
                                max_queued=max_queued)

    def check(self, kind: str, spec: str) -> None:
        self._to_regex(kind, spec)

    def submit(self, kind: str, spec: str) -> concurrent.futures.Future:
        """Future of an OutlinesGrammar; GrammarError (raised or in the future) when it cannot be built."""
        regex = self._to_regex(kind, spec)
        outer: concurrent.futures.Future = concurrent.futures.Future()
        try:
            inner = self.pool.submit(regex)
        except RuntimeError as exc:  # the compile pool has shut down
            raise GrammarShutDownError(str(exc)) from None
        inner.add_done_callback(lambda done: self._finish(kind, spec, regex, outer, done))
        return outer

    def stats(self) -> dict:
        return dict(self.pool.stats)

    def shutdown(self) -> None:
        self.pool.shutdown()

    def _to_regex(self, kind: str, spec: str) -> str:
        if kind == "regex":
            check_regex_syntax(spec)
            return ascii_shorthand_classes(spec)
        if kind == "json":
            try:
                schema = json.loads(spec)
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: {e}") from None
            # annotations, unknown keywords and formats as the specification reads; no rewrites (the translation
            # takes no anyOf / allOf of their shapes)
            schema = prepare_schema(schema, rewrite=False)
            return ascii_shorthand_classes(json_schema_to_regex(schema, self.whitespace_pattern))
        raise GrammarError(f"the outlines engine compiles regex and JSON schema, not {kind}")

    def _finish(self, kind, spec, regex, outer: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
        exc = done.exception()
        if exc is not None:
            outer.set_exception(exc if isinstance(exc, GrammarError) else GrammarError(str(exc)))
            return
        try:
            grammar = OutlinesGrammar(kind, spec, regex, done.result(), self._tables, self.vocab_size, self.tokenizer)
            grammar.bitmask_row(grammar.initial_cursor().fsm_state)  # here, off the scheduler's thread
        except Exception as exc:  # noqa: BLE001 - the waiting request must end either way
            outer.set_exception(GrammarError(f"cannot use the compiled grammar: {exc}"))
            return
        outer.set_result(grammar)


__all__ = ["OutlinesEngine", "OutlinesGrammar", "OutlinesState"]
