"""ProgramState (the `s` a program appends to) and ForkGroup (what `s.fork(n)` returns)."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

from braid import ir
from braid.errors import ProgramError
from braid.interpreter import StreamExecutor
from braid.run_trace import RunTrace


class ProgramState:
    def __init__(self, executor: StreamExecutor):
        self._executor = executor
        self._copy_group: Optional["ForkGroup"] = None  # set on the state s.copy() returns

    # ---- appending ------------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> "ProgramState":
        self._executor.submit(ir.as_node(other))
        return self

    def append(self, other: Any) -> None:
        self._executor.submit(ir.as_node(other))

    @contextmanager
    def _role_block(self, role: str) -> Iterator["ProgramState"]:
        self._executor.submit(ir.RoleBegin(role))
        try:
            yield self
        finally:
            self._executor.submit(ir.RoleEnd(role))

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is None:
            return self._role_block(role)
        self._executor.submit(ir.Concat([ir.RoleBegin(role), ir.as_node(expr), ir.RoleEnd(role)]))
        return None

    def system(self, expr: Any = None):
        """`with s.system(): s += ...`, or (as in SGLang) `s.system(expr)`, the same as `s += braid.system(expr)`."""
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator["ProgramState"]:
        """Everything appended inside the block also becomes variable `name`."""
        self._executor.submit(ir.VarScopeBegin(name))
        try:
            yield self
        finally:
            self._executor.submit(ir.VarScopeEnd(name))

    # ---- reading --------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def get_var(self, name: str) -> Any:
        return self._executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        """While the program runs, the assignment takes its place among the appended nodes; after `run()`
        (as in SGLang) it sets the variable at once."""
        if self._executor.ended:
            self._executor.sync()
            self._executor.set_var(name, value)
        else:
            self._executor.submit(ir.SetVar(name, value))

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._executor.variables

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._executor.variables)

    def text(self) -> str:
        self.sync()
        return self._executor.text_

    def messages(self) -> list[dict]:
        self.sync()
        return list(self._executor.messages_)

    def get_meta_info(self, name: str) -> Any:
        self._executor.get_var(name)
        return self._executor.meta_info.get(name)

    @property
    def arguments(self) -> dict[str, Any]:
        return dict(self._executor.arguments)

    @property
    def backend(self):
        return self._executor.backend

    @property
    def chat_template(self):
        return self._executor.template

    def error(self) -> Optional[BaseException]:
        """The exception that stopped the program, if any (without raising it)."""
        return self._executor.error

    def trace(self) -> "RunTrace":
        """The run trace of this state's run (or batch), once its nodes ran (a failed program's too): a
        JSON-serialisable dict, schema in braid.run_trace; `.save_html(path)` draws it as one web page."""
        recorder = self._executor.recorder
        if recorder is None:
            raise ProgramError("this state was run without recording: pass trace=True to run() / run_batch() "
                               "or set braid.global_config.trace = True")
        self._executor.wait_idle()
        return recorder.export()

    def sync(self) -> None:
        self._executor.sync()

    # ---- streaming ------------------------------------------------------------------------------
    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Text as it is produced: every piece of the prompt, or only variable `var_name`'s deltas."""
        return self._executor.iter_chunks(var_name)

    async def text_async_iter(self, var_name: Optional[str] = None) -> AsyncIterator[str]:
        executor = self._executor
        if not executor.stream:
            for piece in executor.iter_chunks(var_name):
                yield piece
            return
        loop = asyncio.get_running_loop()
        start = 0
        while True:
            deltas, start, over = await loop.run_in_executor(None, executor.wait_chunks, start, var_name)
            for d in deltas:
                yield d
            if over:
                return

    # ---- fork -----------------------------------------------------------------------------------
    def fork(self, n: int = 1, cache_prefix: bool = True) -> "ForkGroup":
        """n copies of this state that continue independently; the shared prefix is sent to the
        backend once (a zero-token prefill) so every branch reuses its cached KV."""
        children = self._executor.fork(n, cache_prefix=cache_prefix)
        return ForkGroup([ProgramState(c) for c in children], self)

    def copy(self) -> "ProgramState":
        """An independent copy of this state. As in SGLang it also works as `with s.copy() as c: ...`, which
        joins the copy back at the end of the block (its variables become one-item lists in `s`)."""
        group = self.fork(1, cache_prefix=False)
        state = group[0]
        state._copy_group = group
        return state

    def __enter__(self) -> "ProgramState":
        if self._copy_group is None:
            raise ProgramError("only s.copy() gives a state to use in a with block")
        return self

    def __exit__(self, *exc: Any) -> None:
        group = self._copy_group
        if not group._joined:
            group.join()

    def __repr__(self) -> str:
        return f"ProgramState({self._executor.text_!r})"


class ForkGroup:
    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states = states
        self.parent = parent
        self._joined = False

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        """Completes `forks[i] += expr` (which appends to branch i, then assigns the branch back); a branch
        cannot be replaced by another state."""
        if state is not self.states[i]:
            raise ProgramError(f"forks[{i}] can only be appended to (forks[{i}] += ...), not replaced")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Union[Callable[[int], Any], list, tuple, Any]) -> "ForkGroup":
        """`forks += expr` appends expr to every branch; `forks += lambda i: ...` appends f(i) to branch i;
        `forks += [e0, e1, ...]` appends e_i to branch i (one per branch)."""
        if isinstance(other, (list, tuple)) and len(other) != len(self.states):
            raise ProgramError(f"forks += list needs one item per branch: {len(self.states)} branches, "
                               f"{len(other)} items")
        for i, state in enumerate(self.states):
            if isinstance(other, (list, tuple)):
                item = other[i]
            else:
                item = other(i) if callable(other) else other
            if item is not None:
                state += item
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. gather_variable: each variable set in the branches becomes, in the
        parent, the list of its per-branch values (meta info likewise). concate_and_append: the
        branches' new text is appended to the parent, in branch order."""
        if self._joined:
            raise ProgramError("this fork group was already joined")
        executors = [s._executor for s in self.states]
        for ex in executors:
            ex.sync()
        parent = self.parent._executor
        if mode == "gather_variable":
            names: dict[str, None] = {}
            for ex in executors:
                names.update(ex.vars_set_since_fork)
            for name in names:
                values = [ex.variables.get(name) for ex in executors]
                metas = [ex.meta_info.get(name) for ex in executors]
                parent.set_var(name, values, metas if any(m is not None for m in metas) else None)
        elif mode == "concate_and_append":
            self.parent += "".join(ex.text_[ex.fork_text_len:] for ex in executors)
        else:
            raise ProgramError(f"unknown join mode {mode!r}; use 'gather_variable' or 'concate_and_append'")
        for ex in executors:
            ex.end()
        self._joined = True
