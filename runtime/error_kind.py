"""The kinds of error the scheduler reports to whoever submitted a request (the server process over IPC, or the
in-process Engine), and what each becomes there.

A kind rides as a typed field of the messages (`ReqError.kind`, `Output.error_kind`, `FinishReason.kind`), never as
a class name or a prefix of the message text. The HTTP side maps it to a status and an OpenAI error type in one
table (`server/errors.py: for_kind`); the Engine raises `exception_for(kind, message)`; the scheduler tells an
exception's kind by its type (`scheduler/intake.py: error_kind_of`).

Imports nothing of the runtime (torch-free: the messages module imports it).
"""

from __future__ import annotations

import enum


class ErrorKind(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"  # the request's own fields: HTTP 400, ValueError in process
    GRAMMAR_INVALID = "grammar_invalid"  # its regex / schema / grammar cannot be used (or compiling timed out): 400
    GRAMMAR_BUSY = "grammar_busy"  # the grammar compile queue is full, a load condition: 429, BusyError
    INTERNAL = "internal"  # a bug on the runtime's side: 500, RuntimeError


GRAMMAR_KINDS = frozenset({ErrorKind.GRAMMAR_INVALID, ErrorKind.GRAMMAR_BUSY})


class BusyError(RuntimeError):
    """The runtime cannot take the request now; the same request may succeed later (the server's 429)."""


def exception_for(kind: ErrorKind, message: str) -> Exception:
    """The in-process twin of what the server answers for `kind`."""
    if kind in (ErrorKind.INVALID_REQUEST, ErrorKind.GRAMMAR_INVALID):
        return ValueError(message)
    if kind == ErrorKind.GRAMMAR_BUSY:
        return BusyError(message)
    return RuntimeError(message)
