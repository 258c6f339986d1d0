"""Tracing: run a program without a model to find the constant text every run of it starts with.

Arguments not given are replaced by placeholder strings carrying a marker; the program runs on a
StreamExecutor whose backend stops at the first node that needs a model or an input (gen, select,
image, video, fork). The constant prefix is the text before that point and before the first marker.
A program that branches on an argument's value is traced along the branch the placeholder takes;
the prefix is only used to warm the cache, so that costs a wasted prefill, never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from braid import ir
from braid.backends.base import ALL_CAPABILITIES, Backend, GenOutput
from braid.chat_template import ChatTemplate
from braid.interpreter import StreamExecutor
from braid.runtime.sampling_params import SamplingParams
from braid.state import ProgramState

MARK = "\x00"


class ArgumentPlaceholder(str):
    """Stands for an argument during tracing; survives concatenation and f-strings as its marker."""

    def __new__(cls, name: str) -> "ArgumentPlaceholder":
        obj = super().__new__(cls, f"{MARK}{name}{MARK}")
        obj.arg_name = name
        return obj


class StopTrace(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class TracingBackend(Backend):
    """Renders like the real backend (same chat template) and stops at anything dynamic."""

    capabilities = ALL_CAPABILITIES

    def __init__(self, template: ChatTemplate):
        self._template = template

    def get_chat_template(self) -> ChatTemplate:
        return self._template

    def require(self, capability: str, needed_by: Optional[str] = None) -> None:
        raise StopTrace(needed_by or capability)

    def generate(self, prompt, sampling_params, logprobs=None) -> GenOutput:
        raise StopTrace("gen")


@dataclass
class Trace:
    prefix: str  # text every run starts with
    text: str  # all text appended before the stop, placeholders as their markers
    stopped_at: Optional[str]  # what ended the constant part ("gen('x')", "argument 'q'", ...); None: nothing did
    nodes: list[ir.Node] = field(default_factory=list)  # leaf nodes visited, the stopping one last
    error: Optional[BaseException] = None  # an exception the program raised under tracing


def trace_program(func: Any, template: ChatTemplate, args: tuple, kwargs: dict, placeholder_names: list[str]) -> Trace:
    call_kwargs = dict(kwargs)
    for name in placeholder_names:
        call_kwargs.setdefault(name, ArgumentPlaceholder(name))
    executor = StreamExecutor(TracingBackend(template), SamplingParams(), record_nodes=True)
    state = ProgramState(executor)
    error: Optional[BaseException] = None
    body_stop: Optional[str] = None
    try:
        func(state, *args, **call_kwargs)
    except StopTrace as e:  # raised in the program's own thread (fork)
        body_stop = e.reason
    except Exception as e:  # noqa: BLE001 - reported in the Trace; everything before it is still constant
        error = e
    executor.end()
    executor.wait_finished()
    stop = executor.error.reason if isinstance(executor.error, StopTrace) else body_stop
    if executor.error is not None and stop is None and error is None:
        error = executor.error
    text = executor.text_
    cut = text.find(MARK)
    if cut >= 0:
        name = text[cut + 1:text.find(MARK, cut + 1)]
        return Trace(text[:cut], text, f"argument {name!r}", executor.recorded or [], error)
    if stop is None and error is not None:
        stop = f"error: {error!r}"
    return Trace(text, text, stop, executor.recorded or [], error)
