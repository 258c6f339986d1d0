"""Run traces: what every gen / select / prefill of a program did, recorded by the interpreter when asked.

`f.run(..., trace=True)` (or `f.run_batch(..., trace=True)`, or `global_config.trace = True` for every run) gives
each program state a `TraceRecorder`; `state.trace()` exports a `RunTrace`, a JSON-serialisable dict of this schema
("braid.trace/1"; times are seconds since `started_at`, the recorder's start):

    schema      "braid.trace/1"
    started_at  unix time the recording began
    duration_s  last call's end (or the export time when no call ended)
    backend     the backend's repr
    scopes      [{"id", "parent": id | None, "kind": "program" | "batch" | "batch_item" | "fork_branch",
                  "name": function name, "index": batch item / branch index or None,
                  "arguments": {name: repr} (programs), "text": the text this scope added (a fork branch's
                  starts after the fork point), "fork_at": where in the parent's "text" a fork branch began
                  (None for other kinds), "error": str | None}]
    calls       [{"id", "scope", "kind": "gen" | "select" | "prefill", "name": variable or None,
                  "span": [start, end] of the produced text in the scope's "text" (None for prefill),
                  "text": what the call produced, "args": non-default sampling fields (constraint left out),
                  "constraint": {"type": "regex" | "json_schema" | "ebnf" | "structural_tag" | "choices",
                                 "value": str} | None,
                  "t_sent", "t_first_token" (None when neither a stream nor the server told), "t_done",
                  "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason" (None when the backend
                  did not say), "tokens": [{"text", "id", "logprob", "top": [[text, logprob], ...]}] (None when
                  the backend returns no logprobs), "speculated": true when cut from an earlier speculative call,
                  "error": str | None,
                  select only: "choices": [{"text", "score", "token_logprobs": [float] | None}], "decision": index,
                  "method": choices method name}]
    summary     {"calls", "gens", "selects", "prompt_tokens", "completion_tokens", "cached_tokens",
                 "cached_share": cached / prompt tokens (None when no call reported prompt tokens), "wall_s",
                 "call_s": summed call durations}

Recording costs a `None` check per call when off. When on, a gen on a backend with logprobs also asks for its
tokens' logprobs and `TOP_LOGPROBS` alternatives (removed again from the meta_info the program sees unless it asked).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, Optional

from braid.errors import ProgramError
from braid.runtime.sampling_params import GRAMMAR_FIELDS, SamplingParams

SCHEMA = "braid.trace/1"
TOP_LOGPROBS = 5
_ARG_REPR_CHARS = 200
_DEFAULT_SP = SamplingParams()
_SAMPLING_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs")


class TraceRecorder:
    """Collects scopes and calls from any number of executor threads (one recorder per traced run or batch)."""

    def __init__(self, backend: Any = None):
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.started_at = time.time()
        self.backend = repr(backend) if backend is not None else None
        self._scopes: list[dict] = []
        self._executors: dict[int, Any] = {}  # scope id -> the StreamExecutor whose text it shows
        self._calls: list[dict] = []

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add_scope(self, kind: str, name: Optional[str], parent: Optional[int] = None, index: Optional[int] = None,
                  arguments: Optional[dict] = None, executor: Any = None, fork_at: Optional[int] = None) -> int:
        scope = {"id": 0, "parent": parent, "kind": kind, "name": name, "index": index, "fork_at": fork_at,
                 "arguments": {k: _short_repr(v) for k, v in (arguments or {}).items()}, "text": "", "error": None}
        with self._lock:
            scope["id"] = len(self._scopes)
            self._scopes.append(scope)
            if executor is not None:
                self._executors[scope["id"]] = executor
        return scope["id"]

    def attach(self, scope_id: int, executor: Any) -> None:
        with self._lock:
            self._executors[scope_id] = executor

    def add_call(self, call: dict) -> None:
        with self._lock:
            call["id"] = len(self._calls)
            self._calls.append(call)

    def export(self) -> "RunTrace":
        with self._lock:
            scopes = [dict(s) for s in self._scopes]
            calls = [dict(c) for c in self._calls]
            executors = dict(self._executors)
        for scope in scopes:
            executor = executors.get(scope["id"])
            if executor is not None:
                text, start, error = executor.trace_text()
                scope["text"] = text[start:]
                scope["error"] = None if error is None else f"{type(error).__name__}: {error}"
        ends = [c["t_done"] for c in calls if c.get("t_done") is not None]
        trace = RunTrace(schema=SCHEMA, started_at=self.started_at, duration_s=max(ends) if ends else self.now(),
                         backend=self.backend, scopes=scopes, calls=calls)
        trace["summary"] = summarize(trace)
        return trace


def summarize(trace: dict) -> dict:
    calls = trace["calls"]

    def total(key: str) -> Optional[int]:
        values = [c[key] for c in calls if isinstance(c.get(key), int)]
        return sum(values) if values else None

    prompt, cached = total("prompt_tokens"), total("cached_tokens")
    starts = [c["t_sent"] for c in calls if c.get("t_sent") is not None]
    ends = [c["t_done"] for c in calls if c.get("t_done") is not None]
    return {
        "calls": len(calls),
        "gens": sum(c["kind"] == "gen" for c in calls),
        "selects": sum(c["kind"] == "select" for c in calls),
        "prompt_tokens": prompt,
        "completion_tokens": total("completion_tokens"),
        "cached_tokens": cached,
        "cached_share": (cached or 0) / prompt if prompt else None,
        "wall_s": max(ends) - min(starts) if starts and ends else 0.0,
        "call_s": sum(c["t_done"] - c["t_sent"] for c in calls
                      if c.get("t_done") is not None and c.get("t_sent") is not None),
    }


class RunTrace(dict):
    """A trace as data (see the module docstring for its schema); a plain dict for json.dumps."""

    def to_json(self) -> str:
        return json.dumps(self, allow_nan=False, default=_jsonable)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    def to_html(self) -> str:
        from braid.trace_page import render_trace_page

        return render_trace_page(self)

    def save_html(self, path: str) -> None:
        """Write one self-contained HTML page (inline script and style, nothing fetched) that draws this trace."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_html())

    @classmethod
    def load(cls, path: str) -> "RunTrace":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise ProgramError(f"{path} is not JSON: {e}") from None
        return cls.from_data(data, where=path)

    @classmethod
    def from_data(cls, data: Any, where: str = "trace") -> "RunTrace":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ProgramError(f"{where} is not a braid trace (schema {SCHEMA!r} expected, found {found!r})")
        for key in ("scopes", "calls"):
            if not isinstance(data.get(key), list):
                raise ProgramError(f"{where}: {key!r} must be a list")
        trace = cls(data)
        trace.setdefault("summary", summarize(trace))
        return trace


def merge_traces(traces: list[dict]) -> RunTrace:
    """Several runs' traces as one (scope and call ids renumbered, times moved onto the earliest start)."""
    if not traces:
        raise ProgramError("no traces to merge")
    start = min(t["started_at"] for t in traces)
    scopes, calls, duration = [], [], 0.0
    for t in traces:
        shift, scope_base, call_base = t["started_at"] - start, len(scopes), len(calls)
        for s in t["scopes"]:
            scopes.append({**s, "id": s["id"] + scope_base,
                           "parent": None if s["parent"] is None else s["parent"] + scope_base})
        for c in t["calls"]:
            moved = {k: (c[k] + shift if c.get(k) is not None else None) for k in ("t_sent", "t_first_token", "t_done")}
            calls.append({**c, **moved, "id": c["id"] + call_base, "scope": c["scope"] + scope_base})
        duration = max(duration, shift + t["duration_s"])
    backends = sorted({t.get("backend") for t in traces if t.get("backend")})
    merged = RunTrace(schema=SCHEMA, started_at=start, duration_s=duration, backend=", ".join(backends) or None,
                      scopes=scopes, calls=calls)
    merged["summary"] = summarize(merged)
    return merged


# ---- the process-wide collection (global_config.trace) -----------------------------------------------
_collected: list[TraceRecorder] = []
_collected_lock = threading.Lock()


def new_recorder(backend: Any) -> TraceRecorder:
    """A recorder for one run or batch; with global_config.trace on it is also kept for `collected_trace()`."""
    from braid.global_config import global_config

    recorder = TraceRecorder(backend)
    if global_config.trace:
        with _collected_lock:
            _collected.append(recorder)
    return recorder


def collected_trace(clear: bool = False) -> RunTrace:
    """Every run recorded since global_config.trace was turned on (or since the last clear), as one trace."""
    with _collected_lock:
        recorders = list(_collected)
        if clear:
            _collected.clear()
    if not recorders:
        raise ProgramError("no traced runs: set braid.global_config.trace = True before running programs")
    return merge_traces([r.export() for r in recorders])


# ---- building call records (the interpreter's worker threads) ----------------------------------------
def sampling_fields(sp: SamplingParams) -> tuple[dict, Optional[dict]]:
    """(non-default sampling fields without the grammar, the grammar as {"type", "value"} or None). Compared field by
    field against one default instance: SamplingParams.to_dict deep-copies and costs ~100 us a call."""
    args = {name: getattr(sp, name) for name in _SAMPLING_FIELD_NAMES if getattr(sp, name) != getattr(_DEFAULT_SP, name)}
    constraint = None
    for field in GRAMMAR_FIELDS:
        value = args.pop(field, None)
        if value is not None and constraint is None:
            constraint = {"type": field, "value": value if isinstance(value, str) else json.dumps(value)}
    return args, constraint


def meta_fields(meta: Optional[dict], t_sent: float, t_done: float) -> dict:
    """What a call record takes from a backend's meta_info (keys the backend did not give stay None)."""
    meta = meta or {}
    finish = meta.get("finish_reason")
    ttft = meta.get("time_to_first_token")
    return {
        "prompt_tokens": _int_or_none(meta.get("prompt_tokens")),
        "completion_tokens": _int_or_none(meta.get("completion_tokens")),
        "cached_tokens": _int_or_none(meta.get("cached_tokens")),
        "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
        "t_first_token": min(t_sent + float(ttft), t_done) if isinstance(ttft, (int, float)) else None,
        "tokens": tokens_from_meta(meta),
    }


def tokens_from_meta(meta: dict) -> Optional[list[dict]]:
    """The output tokens from native-API logprob entries ([logprob, id] or [logprob, id, text])."""
    entries = meta.get("output_token_logprobs")
    if not entries:
        return None
    tops = meta.get("output_top_logprobs") or []
    tokens = []
    for i, entry in enumerate(entries):
        top = tops[i] if i < len(tops) and tops[i] else []
        tokens.append({"logprob": _float_or_none(entry[0]), "id": entry[1] if len(entry) > 1 else None,
                       "text": entry[2] if len(entry) > 2 else None,
                       "top": [[t[2] if len(t) > 2 else f"#{t[1]}", _float_or_none(t[0])] for t in top]})
    return tokens


def _int_or_none(value: Any) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float_or_none(value: Any) -> Optional[float]:
    if not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        return None
    return float(value)


def _short_repr(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _ARG_REPR_CHARS else text[:_ARG_REPR_CHARS] + "…"


def _jsonable(value: Any) -> Any:
    return repr(value)
