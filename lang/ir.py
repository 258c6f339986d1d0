"""The program IR: small nodes a program appends to its state; the interpreter visits each kind.

Nodes are plain data. `a + b` on nodes (or a node and a str) builds a `Concat`, so
`s += "Q: " + gen("x")` works. Every node type is listed in NODE_TYPES; the interpreter has
exactly one visit method per entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from braid.errors import ProgramError


class Node:
    def __add__(self, other: Any) -> "Concat":
        return Concat([self, as_node(other)])

    def __radd__(self, other: Any) -> "Concat":
        return Concat([as_node(other), self])


@dataclass(eq=False)
class Text(Node):
    value: str


@dataclass(eq=False)
class Concat(Node):
    items: list[Node]

    def __add__(self, other: Any) -> "Concat":
        return Concat([*self.items, as_node(other)])


@dataclass(eq=False)
class Gen(Node):
    name: Optional[str]
    sampling: dict[str, Any]  # SamplingParams field name -> override (None-free)
    return_logprob: bool = False
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    dtype: Optional[type] = None
    return_text_in_logprobs: bool = False


@dataclass(eq=False)
class Select(Node):
    name: Optional[str]
    choices: list[str]
    temperature: float
    method: Any  # a braid.choices.ChoicesMethod


@dataclass(eq=False)
class Image(Node):
    data_url: str


@dataclass(eq=False)
class Video(Node):
    frame_data_urls: list[str]
    source: str = ""


@dataclass(eq=False)
class RoleBegin(Node):
    role: str


@dataclass(eq=False)
class RoleEnd(Node):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Node):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Node):
    name: str


@dataclass(eq=False)
class SetVar(Node):
    name: str
    value: Any = field(default=None)


# gen(dtype=...) constraints, named as SGLang's sglang.lang.ir names them. A number may end with one space or
# newline and then must stop (a model that does not stop on its own is cut there, not at max_tokens); digit runs
# are bounded like the JSON-schema regexes' (int64 has 19 digits).
REGEX_INT = r"-?(0|[1-9][0-9]{0,18})[ \n]?"
REGEX_FLOAT = r"-?(0|[1-9][0-9]{0,18})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,3})?[ \n]?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r'"([^"\\\n]|\\["\\nt])*"'

NODE_TYPES: tuple[type, ...] = (Text, Concat, Gen, Select, Image, Video, RoleBegin, RoleEnd,
                                VarScopeBegin, VarScopeEnd, SetVar)

NodeLike = Union[Node, str]


def as_node(value: Any) -> Node:
    if isinstance(value, Node):
        return value
    if isinstance(value, str):
        return Text(value)
    raise ProgramError(f"a program can append only str or braid expressions, got {type(value).__name__}: {value!r}")


def flatten(node: Node) -> list[Node]:
    """The leaf nodes of `node` in order (Concat expanded)."""
    if isinstance(node, Concat):
        out: list[Node] = []
        for item in node.items:
            out.extend(flatten(item))
        return out
    return [node]
