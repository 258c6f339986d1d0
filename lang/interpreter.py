"""The interpreter: one StreamExecutor (and worker thread) per program state.

The program's thread submits nodes; the worker visits them in order, one visit method per node type
(dispatch through `_DISPATCH`, built from ir.NODE_TYPES). A node that fails stores the exception;
later nodes are skipped and the exception is raised to whoever waits on the state next.
"""

from __future__ import annotations

import itertools
import json
import math
import queue
import re
import threading
from typing import Any, Callable, Iterator, Optional

from braid import ir
from braid.backends.base import (CAP_CHOICES_METHODS, CAP_FORK, CAP_GEN, CAP_IMAGE, CAP_JSON_SCHEMA, CAP_LOGPROBS,
                                 CAP_PREFIX_CACHE, CAP_REGEX, CAP_SELECT, CAP_STOP_TOKEN_IDS, CAP_STREAM, CAP_VIDEO,
                                 Backend, LogprobRequest, Prompt)
from braid.chat_template import ChatTemplate
from braid.choices import ChoicesDecision, token_length_normalized
from braid.errors import ProgramError
from braid.run_trace import LOGPROB_KEYS, TOP_LOGPROBS, TraceRecorder, meta_fields, sampling_fields
from braid.runtime.sampling_params import SamplingParams
from braid.sampling import convert_dtype, merge
from braid.speculation import is_speculable
from braid.speculative_run import SpeculativeRun

_END = object()
_SETTLE = object()  # a waiting thread asks the worker to settle a speculative gen
_ids = itertools.count()


class StreamExecutor:
    def __init__(self, backend: Backend, defaults: SamplingParams, *, stream: bool = False,
                 chat_template: Optional[ChatTemplate] = None, arguments: Optional[dict] = None,
                 record_nodes: bool = False, num_api_spec_tokens: Optional[int] = None,
                 recorder: Optional[TraceRecorder] = None, trace_scope: Optional[int] = None):
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.template = chat_template or backend.get_chat_template()
        self.arguments = dict(arguments or {})
        self.recorded: Optional[list[ir.Node]] = [] if record_nodes else None
        # run trace (braid.run_trace); None: not recording, and every call site skips it with one check
        self.recorder = recorder
        self.trace_scope = trace_scope

        # API speculative execution (braid.speculation); None: off
        self.num_api_spec_tokens = num_api_spec_tokens
        self._spec = SpeculativeRun(self) if num_api_spec_tokens is not None else None

        # program state: written by the worker, read by others under _cond
        self.text_ = ""
        self.images_: list[str] = []
        self.videos_: list[tuple[str, ...]] = []
        self.messages_: list[dict] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.last_meta_info: Optional[dict] = None
        self.role: Optional[str] = None
        self._role_parts: list[tuple[str, str]] = []  # ("text" | "image", text or data URL)
        self._loose_text = False
        self._scopes: dict[str, int] = {}

        # fork bookkeeping (set on children)
        self.fork_text_len = 0
        self.vars_set_since_fork: dict[str, None] = {}  # ordered set
        self._children: list[StreamExecutor] = []

        # worker
        self._cond = threading.Condition()
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._pending = 0
        self._error: Optional[BaseException] = None
        self._ended = False
        self._finished = False
        self._chunks: list[tuple[Optional[str], str]] = []  # stream mode: (variable or None, text delta)
        self._done_vars: set[str] = set()
        self._thread = threading.Thread(target=self._work, name=f"braid-executor-{next(_ids)}", daemon=True)
        self._thread.start()

    # ---- submission and waiting (any thread) ------------------------------------------------
    def submit(self, node: ir.Node) -> None:
        if self._ended:
            raise ProgramError("this program state has finished; it takes no more nodes")
        with self._cond:
            self._pending += 1
        self._queue.put(node)

    def sync(self) -> None:
        """Wait until every submitted node ran; raise the program's error if one happened."""
        self._wait_idle()
        with self._cond:
            if self._error is not None:
                raise self._error

    def _wait_idle(self) -> None:
        """Wait until the worker ran every node; a speculative gen still waiting for the program's next literal
        (or a chat model's collected assistant block) is settled first: the waiting thread appends nothing more
        until this returns."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)
            unsettled = self._spec is not None and self._spec.unsettled
            if not unsettled or self._error is not None or self._ended:
                return
            self._pending += 1
        self._queue.put(_SETTLE)
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def wait_idle(self) -> None:
        """Wait until every submitted node ran, without raising the program's error."""
        self._wait_idle()

    def end(self) -> None:
        """No more nodes: the worker exits once the queue is drained. Ends forked children too."""
        if not self._ended:
            with self._cond:
                self._pending += 1  # the worker settles a waiting speculative gen at the end
            self._ended = True
            self._queue.put(_END)
        for child in self._children:
            child.end()

    def fail(self, error: BaseException) -> None:
        """Record an error raised outside the worker (the program body itself)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def wait_finished(self, timeout: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._finished, timeout)

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def trace_text(self) -> tuple[str, int, Optional[BaseException]]:
        """(the text so far, where this state's own text starts (after a fork point), the error) for a trace."""
        with self._cond:
            return self.text_, self.fork_text_len, self._error

    @property
    def ended(self) -> bool:
        return self._ended

    def get_var(self, name: str) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: name in self.variables or self._error is not None or self._pending == 0)
        if name not in self.variables and self._error is None:
            self._wait_idle()
        with self._cond:
            if name in self.variables:
                return self.variables[name]
            if self._error is not None:
                raise self._error
        raise ProgramError(f"variable {name!r} is not set (set: {', '.join(sorted(self.variables)) or 'none'})")

    def set_var(self, name: str, value: Any, meta: Any = None) -> None:
        with self._cond:
            self.variables[name] = value
            self.vars_set_since_fork[name] = None
            if meta is not None:
                self.meta_info[name] = meta
            self._done_vars.add(name)
            self._cond.notify_all()

    def snapshot(self) -> Prompt:
        with self._cond:
            return Prompt(
                text=self.text_,
                images=tuple(self.images_),
                videos=tuple(self.videos_),
                messages=tuple(self.messages_),
                open_role=self.role,
                open_role_text="".join(v for kind, v in self._role_parts if kind == "text"),
                loose_text=self._loose_text,
            )

    # ---- streaming ------------------------------------------------------------------------------
    def _stream_over(self, var: Optional[str]) -> bool:
        if self._finished or self._error is not None:
            return True
        return var is not None and var in self._done_vars

    def wait_chunks(self, start: int, var: Optional[str]) -> tuple[list[str], int, bool]:
        """Block until chunks past `start` exist or the stream of `var` (None: everything) is over.
        Returns (new deltas of var, next start, over)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._chunks) > start or self._stream_over(var))
            new = self._chunks[start:]
            over = self._stream_over(var)
            if over and self._error is not None and not (var is not None and var in self._done_vars):
                raise self._error
            return [d for v, d in new if var is None or v == var], start + len(new), over

    def iter_chunks(self, var: Optional[str] = None) -> Iterator[str]:
        if not self.stream:
            self.sync()
            yield self.text_ if var is None else str(self.get_var(var))
            return
        start = 0
        while True:
            deltas, start, over = self.wait_chunks(start, var)
            yield from deltas
            if over:
                return

    # ---- worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            node = self._queue.get()
            try:
                if self._error is None:
                    if node is _END or node is _SETTLE:
                        if self._spec is not None:
                            self._spec.settle()
                    else:
                        self.visit(node)
            except BaseException as e:  # noqa: BLE001 - stored and re-raised to the program's waiter
                self.fail(e)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
            if node is _END:
                break
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def visit(self, node: ir.Node) -> None:
        if self.recorded is not None and not isinstance(node, ir.Concat):
            self.recorded.append(node)
        if self._spec is not None and not isinstance(node, _SPECULATION_AWARE):
            self._spec.leave(node)
        _DISPATCH[type(node)](self, node)

    # ---- text bookkeeping (worker) --------------------------------------------------------------
    def _append(self, text: str, var: Optional[str] = None, generated: bool = False) -> None:
        """Content text: goes into the open role block's content (or counts as loose text). Text the program
        wrote (not `generated` by the model) is checked against a speculation first."""
        if not text:
            return
        if not generated and self._spec is not None:
            self._spec.literal(text)
        with self._cond:
            self.text_ += text
            if self.role is not None:
                if self._role_parts and self._role_parts[-1][0] == "text":
                    self._role_parts[-1] = ("text", self._role_parts[-1][1] + text)
                else:
                    self._role_parts.append(("text", text))
            elif text.strip():
                self._loose_text = True
            if self.stream:
                self._chunks.append((var, text))
                self._cond.notify_all()

    def _append_markup(self, text: str) -> None:
        """Template markup (role markers): in the prompt text, never in a message's content."""
        if self._spec is not None:
            self._spec.literal(text)
        with self._cond:
            self.text_ += text
            if self.stream and text:
                self._chunks.append((None, text))
                self._cond.notify_all()

    def _add_image(self, data_url: str) -> None:
        with self._cond:
            self.text_ += self.template.image_token
            self.images_.append(data_url)
            if self.role is not None:
                self._role_parts.append(("image", data_url))

    def _add_video(self, frames: tuple[str, ...]) -> None:
        with self._cond:
            self.text_ += self.template.video_token
            self.videos_.append(frames)
            if self.role is not None:
                self._role_parts.append(("video", frames))

    def _role_content(self) -> Any:
        if all(kind == "text" for kind, _ in self._role_parts):
            return "".join(v for _, v in self._role_parts)
        parts = {"text": lambda v: {"type": "text", "text": v},
                 "image": lambda v: {"type": "image_url", "image_url": {"url": v}},
                 "video": lambda v: {"type": "video_url", "video_url": {"frames": list(v)}}}
        return [parts[kind](v) for kind, v in self._role_parts]

    # ---- visit methods: one per node type -------------------------------------------------------
    def visit_text(self, node: ir.Text) -> None:
        if self._spec is not None and self._spec.collect_text(node.value):
            return
        self._append(node.value)

    def visit_concat(self, node: ir.Concat) -> None:
        for item in node.items:
            self.visit(item)

    def visit_role_begin(self, node: ir.RoleBegin) -> None:
        if self.role is not None:
            raise ProgramError(f"{node.role}() opened inside the open {self.role}() block; close it first")
        template = self.template
        if (template.default_system_prompt is not None and node.role != "system" and not self.messages_
                and not self.text_.strip()):
            self._append_markup(template.role_prefix("system"))
            self.role = "system"
            self._role_parts = []
            self._append(template.default_system_prompt)
            self._close_role("system")
        self._append_markup(template.role_prefix(node.role))
        self.role = node.role
        self._role_parts = []
        if node.role == "assistant" and self._spec is not None and self.backend.is_chat_model:
            self._spec.open_block()

    def visit_role_end(self, node: ir.RoleEnd) -> None:
        if self.role != node.role:
            opened = f"the open block is {self.role}()" if self.role else "no block is open"
            raise ProgramError(f"{node.role}_end() does not match: {opened}")
        if self._spec is not None:
            self._spec.close_block()
        self._close_role(node.role)

    def _close_role(self, role: str) -> None:
        content = self._role_content()
        self._append_markup(self.template.role_suffix(role))
        with self._cond:
            self.messages_.append({"role": role, "content": content})
            self.role = None
            self._role_parts = []

    def visit_image(self, node: ir.Image) -> None:
        self.backend.require(CAP_IMAGE, "image()")
        self._add_image(node.data_url)

    def visit_video(self, node: ir.Video) -> None:
        self.backend.require(CAP_VIDEO, "video()")
        self._add_video(tuple(node.frame_data_urls))

    def visit_gen(self, node: ir.Gen) -> None:
        backend = self.backend
        what = f"gen({node.name!r})"
        backend.require(CAP_GEN, what)
        sp = merge(self.defaults, node.sampling)
        if sp.regex is not None:
            backend.require(CAP_REGEX, f"{what} with regex/dtype")
        if sp.json_schema is not None:
            backend.require(CAP_JSON_SCHEMA, f"{what} with json_schema")
        for field in ("ebnf", "structural_tag"):
            if getattr(sp, field) is not None:  # the backends that take a regex take these grammars as well
                backend.require(CAP_REGEX, f"{what} with {'grammar' if field == 'ebnf' else field}")
        if sp.stop_token_ids:
            backend.require(CAP_STOP_TOKEN_IDS, f"{what} with stop_token_ids")
        logprobs = LogprobRequest(
            return_logprob=bool(node.return_logprob or node.top_logprobs_num),
            logprob_start_len=-1 if node.logprob_start_len is None else node.logprob_start_len,
            top_logprobs_num=node.top_logprobs_num or 0,
            return_text=node.return_text_in_logprobs,
        )
        if logprobs.return_logprob:
            backend.require(CAP_LOGPROBS, f"{what} with return_logprob")
        if self._spec is not None:
            if is_speculable(node, sp, logprobs.return_logprob):
                self._spec.gen(node, sp)
                return
            self._spec.leave(node)
        self._plain_gen(node, sp, logprobs)

    def _plain_gen(self, node: ir.Gen, sp: SamplingParams, logprobs: LogprobRequest = LogprobRequest()) -> None:
        if self.recorder is not None:
            self._traced_gen(node, sp, logprobs)
            return
        text, meta = self._call_gen(node, sp, logprobs)
        self._finish_gen(node, text, meta)

    def _call_gen(self, node: ir.Gen, sp: SamplingParams, logprobs: LogprobRequest,
                  on_first_delta: Optional[Callable[[], None]] = None) -> tuple[str, dict]:
        """One backend call for a gen, its text appended as it comes; (text, meta_info)."""
        backend = self.backend
        prompt = self.snapshot()
        if self.stream and backend.supports(CAP_STREAM):
            pieces: list[str] = []
            meta: dict = {}
            for delta, chunk_meta in backend.generate_stream(prompt, sp, logprobs):
                if delta:
                    if not pieces and on_first_delta is not None:
                        on_first_delta()
                    pieces.append(delta)
                    self._append(delta, var=node.name, generated=True)
                if chunk_meta is not None:
                    meta = chunk_meta
            return "".join(pieces), meta
        out = backend.generate(prompt, sp, logprobs)
        self._append(out.text, var=node.name, generated=True)
        return out.text, out.meta_info

    def _traced_gen(self, node: ir.Gen, sp: SamplingParams, logprobs: LogprobRequest) -> None:
        """A gen's call, recorded: its tokens' logprobs are asked for when the backend gives them (and taken out of
        the meta_info again when the program did not ask)."""
        added_logprobs = not logprobs.return_logprob and self.backend.supports(CAP_LOGPROBS)
        if added_logprobs:
            logprobs = LogprobRequest(return_logprob=True, top_logprobs_num=TOP_LOGPROBS, return_text=True)
        call = self._trace_call("gen", node.name, sp)
        first: list[float] = []
        try:
            text, meta = self._call_gen(node, sp, logprobs, on_first_delta=lambda: first.append(self.recorder.now()))
        except BaseException as e:
            self._trace_failed(call, e)
            raise
        self._trace_done(call, text, meta, first[0] if first else None)
        if added_logprobs:
            meta = {k: v for k, v in meta.items() if k not in LOGPROB_KEYS}
        self._finish_gen(node, text, meta)

    # ---- run trace records (worker; only while self.recorder is set) -----------------------------
    def _trace_call(self, kind: str, name: Optional[str], sp: Optional[SamplingParams]) -> dict:
        """A call record opened now: arguments, constraint, the span's start and the time sent."""
        args, constraint = sampling_fields(sp) if sp is not None else ({}, None)
        start = len(self.text_) - self.fork_text_len
        return {"id": None, "scope": self.trace_scope, "kind": kind, "name": name, "args": args,
                "constraint": constraint, "span": [start, start] if kind != "prefill" else None, "text": "",
                "t_sent": self.recorder.now(), "t_first_token": None, "t_done": None, "prompt_tokens": None,
                "completion_tokens": None, "cached_tokens": None, "finish_reason": None, "tokens": None,
                "speculated": False, "error": None}

    def _trace_done(self, call: dict, text: str, meta: Optional[dict], first_token: Optional[float] = None) -> None:
        call["t_done"] = self.recorder.now()
        call.update(meta_fields(meta, call["t_sent"], call["t_done"]))
        if first_token is not None:  # seen on a stream: better than the server's figure
            call["t_first_token"] = first_token
        call["text"] = text
        if call["span"] is not None:
            call["span"] = [call["span"][0], call["span"][0] + len(text)]
        self.recorder.add_call(call)

    def _trace_failed(self, call: dict, error: BaseException) -> None:
        call["t_done"] = self.recorder.now()
        call["error"] = f"{type(error).__name__}: {error}"
        self.recorder.add_call(call)

    def _finish_gen(self, node: ir.Gen, text: str, meta: dict) -> None:
        self.last_meta_info = meta
        if node.name is not None:
            value = convert_dtype(node.dtype, text) if node.dtype is not None else text
            self.set_var(node.name, value, meta)

    def _gen_from_speculation(self, node: ir.Gen, text: str, meta: dict) -> None:
        call = self._trace_call("gen", node.name, None) if self.recorder is not None else None
        self._append(text, var=node.name, generated=True)
        if call is not None:
            call["speculated"] = True
            self._trace_done(call, text, meta)
        self._finish_gen(node, text, meta)

    def visit_select(self, node: ir.Select) -> None:
        backend = self.backend
        what = f"select({node.name!r})"
        backend.require(CAP_SELECT, what)
        if node.method is not token_length_normalized:
            backend.require(CAP_CHOICES_METHODS, f"{what} with choices_method={node.method.name}")
        call = self._trace_call("select", node.name, None) if self.recorder is not None else None
        try:
            decision = backend.select(self.snapshot(), list(node.choices), node.temperature, node.method)
        except BaseException as e:
            if call is not None:
                self._trace_failed(call, e)
            raise
        if call is not None:
            self._trace_select(call, node, decision)
        if decision.decision not in node.choices:
            raise ProgramError(f"{backend.name} selected {decision.decision!r}, which is not one of {node.choices}")
        self._append(decision.decision, var=node.name, generated=True)
        self.last_meta_info = decision.meta_info
        if node.name is not None:
            self.set_var(node.name, decision.decision, decision.meta_info)

    def _trace_select(self, call: dict, node: ir.Select, decision: ChoicesDecision) -> None:
        meta = decision.meta_info or {}
        per_choice = meta.get("token_logprobs")
        call["args"] = {"temperature": node.temperature} if node.temperature else {}
        call["constraint"] = {"type": "choices", "value": json.dumps(list(node.choices))}
        call["method"] = meta.get("choices_method", node.method.name)
        call["decision"] = decision.index
        call["choices"] = [{"text": c, "score": _finite(decision.scores[i] if i < len(decision.scores) else None),
                            "token_logprobs": list(per_choice[i]) if per_choice and i < len(per_choice) else None}
                           for i, c in enumerate(node.choices)]
        self._trace_done(call, decision.decision, meta)

    def visit_var_scope_begin(self, node: ir.VarScopeBegin) -> None:
        self._scopes[node.name] = len(self.text_)

    def visit_var_scope_end(self, node: ir.VarScopeEnd) -> None:
        if node.name not in self._scopes:
            raise ProgramError(f"var_scope {node.name!r} ended but never began")
        start = self._scopes.pop(node.name)
        self.set_var(node.name, self.text_[start:])

    def visit_set_var(self, node: ir.SetVar) -> None:
        self.set_var(node.name, node.value)

    # ---- fork (program thread) ------------------------------------------------------------------
    def fork(self, n: int, cache_prefix: bool = True) -> list["StreamExecutor"]:
        if not isinstance(n, int) or n < 1:
            raise ProgramError(f"fork needs a positive number of branches, got {n!r}")
        self.sync()
        self.backend.require(CAP_FORK, "fork()")
        if cache_prefix and n > 1 and self.text_ and self.backend.supports(CAP_PREFIX_CACHE):
            call = self._trace_call("prefill", None, None) if self.recorder is not None else None
            meta = self.backend.cache_prefix(self.snapshot())
            if call is not None:
                self._trace_done(call, "", meta)
        children = []
        for i in range(n):
            scope = None
            if self.recorder is not None:
                scope = self.recorder.add_scope("fork_branch", None, parent=self.trace_scope, index=i,
                                                fork_at=len(self.text_) - self.fork_text_len)
            child = StreamExecutor(self.backend, self.defaults, stream=self.stream, chat_template=self.template,
                                   arguments=self.arguments, num_api_spec_tokens=self.num_api_spec_tokens,
                                   recorder=self.recorder, trace_scope=scope)
            child._copy_state(self)
            if scope is not None:
                self.recorder.attach(scope, child)
            children.append(child)
        self._children.extend(children)
        return children

    def _copy_state(self, parent: "StreamExecutor") -> None:
        with parent._cond:
            self.text_ = parent.text_
            self.images_ = list(parent.images_)
            self.videos_ = list(parent.videos_)
            self.messages_ = list(parent.messages_)
            self.variables = dict(parent.variables)
            self.meta_info = dict(parent.meta_info)
            self.role = parent.role
            self._role_parts = list(parent._role_parts)
            self._loose_text = parent._loose_text
            self._scopes = dict(parent._scopes)
        self.fork_text_len = len(self.text_)
        self.vars_set_since_fork = {}
        self._done_vars = set(self.variables)


def _finite(value: Optional[float]) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


# nodes that handle speculation themselves; any other node first leaves it
_SPECULATION_AWARE = (ir.Text, ir.Concat, ir.Gen, ir.RoleBegin, ir.RoleEnd)

_DISPATCH: dict[type, Callable[[StreamExecutor, Any], None]] = {
    cls: getattr(StreamExecutor, "visit_" + _snake(cls.__name__)) for cls in ir.NODE_TYPES
}
