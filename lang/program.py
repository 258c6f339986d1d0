"""BraidFunction: what `@braid.function` makes of a program (run, run_batch, bind, trace)."""

from __future__ import annotations

import functools
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable, Optional, Union

from braid.backends.base import CAP_PREFIX_CACHE, Backend, Prompt
from braid.defaults import resolve_backend
from braid.errors import ProgramError
from braid.global_config import global_config
from braid.interpreter import StreamExecutor
from braid.run_trace import TraceRecorder, new_recorder
from braid.sampling import defaults_from_keywords, is_sampling_keyword, to_field_overrides
from braid.state import ProgramState
from braid.tracer import Trace, trace_program

_MAX_AUTO_THREADS = 64


class BraidFunction:
    def __init__(self, func: Callable, bound: Optional[dict] = None, default_sampling: Optional[dict] = None,
                 num_api_spec_tokens: Optional[int] = None):
        if not callable(func):
            raise ProgramError("braid.function decorates a function taking the state as its first parameter")
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            raise ProgramError(f"{func.__name__}: a braid function takes the state `s` as its first parameter")
        if num_api_spec_tokens is not None and (isinstance(num_api_spec_tokens, bool)
                                                or not isinstance(num_api_spec_tokens, int) or num_api_spec_tokens < 1):
            raise ProgramError(f"num_api_spec_tokens must be a positive integer, got {num_api_spec_tokens!r}")
        self.num_api_spec_tokens = num_api_spec_tokens
        self.func = func
        self.bound = dict(bound or {})
        self.default_sampling = dict(default_sampling or {})
        to_field_overrides(self.default_sampling)  # reject unknown names now
        self._signature = inspect.signature(func)
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.arg_names = [p.name for p in params[1:] if p.kind in named]
        self._takes_var_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        functools.update_wrapper(self, func)

    # ---- composition ----------------------------------------------------------------------------
    def bind(self, **kwargs: Any) -> "BraidFunction":
        unknown = [k for k in kwargs if k not in self.arg_names and not self._takes_var_kwargs]
        if unknown:
            raise ProgramError(f"{self.__name__}() has no argument(s) {', '.join(unknown)} to bind")
        return BraidFunction(self.func, {**self.bound, **kwargs}, self.default_sampling, self.num_api_spec_tokens)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Called with a state first, runs the body on that state (a sub-program); otherwise run()."""
        if args and isinstance(args[0], ProgramState):
            return self.func(args[0], *args[1:], **{**self.bound, **kwargs})
        return self.run(*args, **kwargs)

    # ---- argument handling ----------------------------------------------------------------------
    def _split(self, args: tuple, kwargs: dict) -> tuple[dict, dict]:
        """(arguments for the body by name, sampling keywords)."""
        fn_kwargs, sampling = {}, {}
        for key, value in kwargs.items():
            if key in self.arg_names or (self._takes_var_kwargs and not is_sampling_keyword(key)):
                fn_kwargs[key] = value
            elif is_sampling_keyword(key):
                sampling[key] = value
            else:
                raise ProgramError(f"{self.__name__}() got an unexpected argument {key!r}")
        try:
            bound = self._signature.bind(None, *args, **{**self.bound, **fn_kwargs})
        except TypeError as e:
            raise ProgramError(f"{self.__name__}(): {e}") from None
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(self._signature.parameters)))
        return arguments, sampling

    def _call_body(self, state: ProgramState, arguments: dict) -> None:
        positional, keywords = [], {}
        for p in list(self._signature.parameters.values())[1:]:
            if p.name not in arguments:
                continue
            if p.kind == inspect.Parameter.VAR_POSITIONAL:
                positional.extend(arguments[p.name])
            elif p.kind == inspect.Parameter.VAR_KEYWORD:
                keywords.update(arguments[p.name])
            elif p.kind == inspect.Parameter.POSITIONAL_ONLY:
                positional.append(arguments[p.name])
            else:
                keywords[p.name] = arguments[p.name]
        self.func(state, *positional, **keywords)

    # ---- running --------------------------------------------------------------------------------
    def run(self, *args: Any, backend: Any = None, stream: bool = False, trace: Optional[bool] = None,
            **kwargs: Any) -> ProgramState:
        """Run the program. kwargs are the program's arguments, plus sampling defaults for every gen
        (gen's own keywords: max_tokens, temperature, stop, ...). With stream=True the state comes back
        at once and fills in the background (read it with text_iter). With trace=True (default:
        global_config.trace) the run records every call; `state.trace()` gives the record (braid.run_trace)."""
        arguments, sampling = self._split(args, kwargs)
        backend = resolve_backend(backend)
        recorder = new_recorder(backend) if _tracing(trace) else None
        return self._run(backend, arguments, sampling, stream, recorder)

    def _run(self, backend: Backend, arguments: dict, sampling: dict, stream: bool,
             recorder: Optional[TraceRecorder] = None, parent_scope: Optional[int] = None,
             index: Optional[int] = None) -> ProgramState:
        defaults = defaults_from_keywords({**self.default_sampling, **sampling})
        if stream and self.num_api_spec_tokens is not None:
            raise ProgramError(f"{self.__name__}: stream=True cannot be combined with num_api_spec_tokens "
                               "(speculated gens are known only once the speculation is cut)")
        scope = None
        if recorder is not None:
            scope = recorder.add_scope("program", self.__name__, parent=parent_scope, index=index, arguments=arguments)
        executor = StreamExecutor(backend, defaults, stream=stream, arguments=arguments,
                                  num_api_spec_tokens=self.num_api_spec_tokens, recorder=recorder, trace_scope=scope)
        if recorder is not None:
            recorder.attach(scope, executor)
        state = ProgramState(executor)
        if stream:
            threading.Thread(target=self._body_in_background, args=(state, arguments), daemon=True,
                             name=f"braid-program-{self.__name__}").start()
            return state
        try:
            self._call_body(state, arguments)
        finally:
            executor.end()
        executor.sync()
        if global_config.verbosity >= 2:
            print(state.text())
        return state

    def _body_in_background(self, state: ProgramState, arguments: dict) -> None:
        try:
            self._call_body(state, arguments)
        except BaseException as e:  # noqa: BLE001 - surfaces to the reader of the state
            state._executor.fail(e)
        finally:
            state._executor.end()

    def run_batch(self, batch_kwargs: list[dict], *, num_threads: Union[int, str] = "auto", progress_bar: bool = True,
                  backend: Any = None, trace: Optional[bool] = None,
                  **sampling: Any) -> list[Union[ProgramState, BaseException]]:
        """Run the program once per dict of arguments, concurrently. Results keep the input order; a
        program that raised has its exception in its slot instead of a state. With trace=True (default:
        global_config.trace) the batch records one trace: each state's `trace()` gives the whole batch's."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise ProgramError("run_batch takes a list of argument dicts")
        for i, item in enumerate(batch_kwargs):
            if not isinstance(item, dict):
                raise ProgramError(f"run_batch item {i} is {type(item).__name__}, not a dict of arguments")
        to_field_overrides(sampling)
        backend = resolve_backend(backend)
        n = len(batch_kwargs)
        if n == 0:
            return []
        recorder, batch_scope = None, None
        if _tracing(trace):
            recorder = new_recorder(backend)
            batch_scope = recorder.add_scope("batch", self.__name__)
        if num_threads == "auto":
            num_threads = min(n, _MAX_AUTO_THREADS)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ProgramError(f"num_threads must be 'auto' or a positive integer, got {num_threads!r}")
        if n > 1 and global_config.enable_precache_with_tracing and backend.supports(CAP_PREFIX_CACHE):
            self.cache_constant_prefix(backend, varying={k for item in batch_kwargs for k in item})

        results: list[Any] = [None] * n

        def run_one(i: int) -> None:
            try:
                arguments, item_sampling = self._split((), batch_kwargs[i])
                results[i] = self._run(backend, arguments, {**sampling, **item_sampling}, stream=False,
                                       recorder=recorder, parent_scope=batch_scope, index=i)
            except Exception as e:  # noqa: BLE001 - reported in the results
                results[i] = e

        from tqdm.auto import tqdm

        with tqdm(total=n, disable=not progress_bar, desc=self.__name__) as bar:
            if num_threads == 1:
                for i in range(n):
                    run_one(i)
                    bar.update(1)
            else:
                with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="braid-batch") as pool:
                    for future in as_completed([pool.submit(run_one, i) for i in range(n)]):
                        future.result()
                        bar.update(1)
        return results

    # ---- tracing --------------------------------------------------------------------------------
    def trace(self, *args: Any, backend: Any = None, **kwargs: Any) -> Trace:
        """Run the body without a model; required arguments not given become placeholders. Returns
        the constant prefix (text before the first gen/select/image/fork or argument) and the nodes seen."""
        fn_kwargs = {k: v for k, v in kwargs.items() if k in self.arg_names or not is_sampling_keyword(k)}
        given = set(self.arg_names[:len(args)]) | set(fn_kwargs) | set(self.bound)
        missing = [name for name in self._required_args() if name not in given]
        return trace_program(self.func, self._template_for(backend), args, {**self.bound, **fn_kwargs}, missing)

    def _required_args(self) -> list[str]:
        params = list(self._signature.parameters.values())[1:]
        return [p.name for p in params if p.name in self.arg_names and p.default is inspect.Parameter.empty]

    @staticmethod
    def _template_for(backend: Any):
        from braid.chat_template import CHATML
        from braid.defaults import get_default_backend

        if backend is None and get_default_backend() is None:
            return CHATML
        return resolve_backend(backend).get_chat_template()

    def cache(self, backend: Any = None) -> Optional[str]:
        """SGLang's `program.cache(backend)`: cache the program's traced constant prefix on the backend."""
        return self.cache_constant_prefix(resolve_backend(backend))

    def cache_constant_prefix(self, backend: Backend, varying: Optional[set] = None) -> Optional[str]:
        """Trace the program with placeholders for its required arguments and for those named in
        `varying`, and have `backend` cache the constant prefix once; returns it (None if empty)."""
        varying = set(varying or ())
        placeholders = [n for n in self.arg_names if n in varying or (n in self._required_args() and n not in self.bound)]
        fixed = {k: v for k, v in self.bound.items() if k not in varying}
        try:
            prefix = trace_program(self.func, backend.get_chat_template(), (), fixed, placeholders).prefix
        except Exception:  # noqa: BLE001 - warming the cache is an optimisation only
            return None
        if not prefix:
            return None
        backend.cache_prefix(Prompt(text=prefix))
        return prefix

    def __repr__(self) -> str:
        return f"<braid.function {self.__name__}>"


def _tracing(trace: Optional[bool]) -> bool:
    if trace is None:
        return global_config.trace
    if not isinstance(trace, bool):
        raise ProgramError(f"trace must be True or False, got {trace!r}")
    return trace
