"""The interpreter: one StreamExecutor (and worker thread) per program state.

The program's thread submits nodes; the worker visits them in order, one visit method per node type
(dispatch through `_DISPATCH`, built from ir.NODE_TYPES). A node that fails stores the exception;
later nodes are skipped and the exception is raised to whoever waits on the state next.
"""

from __future__ import annotations

import itertools
import queue
import re
import threading
from typing import Any, Callable, Iterator, Optional

from braid import ir
from braid.backends.base import (CAP_CHOICES_METHODS, CAP_FORK, CAP_GEN, CAP_IMAGE, CAP_JSON_SCHEMA, CAP_LOGPROBS,
                                 CAP_PREFIX_CACHE, CAP_REGEX, CAP_SELECT, CAP_STOP_TOKEN_IDS, CAP_STREAM, CAP_VIDEO,
                                 Backend, LogprobRequest, Prompt)
from braid.chat_template import ChatTemplate
from braid.choices import token_length_normalized
from braid.errors import ProgramError
from braid.runtime.sampling_params import SamplingParams
from braid.sampling import convert_dtype, merge

_END = object()
_ids = itertools.count()


class StreamExecutor:
    def __init__(self, backend: Backend, defaults: SamplingParams, *, stream: bool = False,
                 chat_template: Optional[ChatTemplate] = None, arguments: Optional[dict] = None,
                 record_nodes: bool = False):
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.template = chat_template or backend.get_chat_template()
        self.arguments = dict(arguments or {})
        self.recorded: Optional[list[ir.Node]] = [] if record_nodes else None

        # program state: written by the worker, read by others under _cond
        self.text_ = ""
        self.images_: list[str] = []
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
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)
            if self._error is not None:
                raise self._error

    def end(self) -> None:
        """No more nodes: the worker exits once the queue is drained. Ends forked children too."""
        if not self._ended:
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

    def get_var(self, name: str) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: name in self.variables or self._error is not None or self._pending == 0)
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
            if node is _END:
                break
            try:
                if self._error is None:
                    self.visit(node)
            except BaseException as e:  # noqa: BLE001 - stored and re-raised to the program's waiter
                self.fail(e)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def visit(self, node: ir.Node) -> None:
        if self.recorded is not None and not isinstance(node, ir.Concat):
            self.recorded.append(node)
        _DISPATCH[type(node)](self, node)

    # ---- text bookkeeping (worker) --------------------------------------------------------------
    def _append(self, text: str, var: Optional[str] = None) -> None:
        """Content text: goes into the open role block's content (or counts as loose text)."""
        if not text:
            return
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

    def _role_content(self) -> Any:
        if all(kind == "text" for kind, _ in self._role_parts):
            return "".join(v for _, v in self._role_parts)
        return [{"type": "text", "text": v} if kind == "text" else {"type": "image_url", "image_url": {"url": v}}
                for kind, v in self._role_parts]

    # ---- visit methods: one per node type -------------------------------------------------------
    def visit_text(self, node: ir.Text) -> None:
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

    def visit_role_end(self, node: ir.RoleEnd) -> None:
        if self.role != node.role:
            opened = f"the open block is {self.role}()" if self.role else "no block is open"
            raise ProgramError(f"{node.role}_end() does not match: {opened}")
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
        for frame in node.frame_data_urls:
            self._add_image(frame)

    def visit_gen(self, node: ir.Gen) -> None:
        backend = self.backend
        what = f"gen({node.name!r})"
        backend.require(CAP_GEN, what)
        sp = merge(self.defaults, node.sampling)
        if sp.regex is not None:
            backend.require(CAP_REGEX, f"{what} with regex/dtype")
        if sp.json_schema is not None:
            backend.require(CAP_JSON_SCHEMA, f"{what} with json_schema")
        if sp.stop_token_ids:
            backend.require(CAP_STOP_TOKEN_IDS, f"{what} with stop_token_ids")
        logprobs = LogprobRequest(
            return_logprob=bool(node.return_logprob or node.top_logprobs_num),
            logprob_start_len=-1 if node.logprob_start_len is None else node.logprob_start_len,
            top_logprobs_num=node.top_logprobs_num or 0,
        )
        if logprobs.return_logprob:
            backend.require(CAP_LOGPROBS, f"{what} with return_logprob")
        prompt = self.snapshot()
        if self.stream and backend.supports(CAP_STREAM):
            pieces: list[str] = []
            meta: dict = {}
            for delta, chunk_meta in backend.generate_stream(prompt, sp, logprobs):
                if delta:
                    pieces.append(delta)
                    self._append(delta, var=node.name)
                if chunk_meta is not None:
                    meta = chunk_meta
            text = "".join(pieces)
        else:
            out = backend.generate(prompt, sp, logprobs)
            text, meta = out.text, out.meta_info
            self._append(text, var=node.name)
        self.last_meta_info = meta
        if node.name is not None:
            value = convert_dtype(node.dtype, text) if node.dtype is not None else text
            self.set_var(node.name, value, meta)

    def visit_select(self, node: ir.Select) -> None:
        backend = self.backend
        what = f"select({node.name!r})"
        backend.require(CAP_SELECT, what)
        if node.method is not token_length_normalized:
            backend.require(CAP_CHOICES_METHODS, f"{what} with choices_method={node.method.name}")
        decision = backend.select(self.snapshot(), list(node.choices), node.temperature, node.method)
        if decision.decision not in node.choices:
            raise ProgramError(f"{backend.name} selected {decision.decision!r}, which is not one of {node.choices}")
        self._append(decision.decision, var=node.name)
        self.last_meta_info = decision.meta_info
        if node.name is not None:
            self.set_var(node.name, decision.decision, decision.meta_info)

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
            self.backend.cache_prefix(self.snapshot())
        children = []
        for _ in range(n):
            child = StreamExecutor(self.backend, self.defaults, stream=self.stream, chat_template=self.template,
                                   arguments=self.arguments)
            child._copy_state(self)
            children.append(child)
        self._children.extend(children)
        return children

    def _copy_state(self, parent: "StreamExecutor") -> None:
        with parent._cond:
            self.text_ = parent.text_
            self.images_ = list(parent.images_)
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


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


_DISPATCH: dict[type, Callable[[StreamExecutor, Any], None]] = {
    cls: getattr(StreamExecutor, "visit_" + _snake(cls.__name__)) for cls in ir.NODE_TYPES
}
