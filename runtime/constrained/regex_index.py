"""Regex -> outlines-core `Index` (its token-level automaton), with a fast syntax pre-check and errors a user can act
on. Importable without torch (the compile worker imports it)."""

from __future__ import annotations

import re
import warnings

from .grammar_errors import GrammarError


def check_regex_syntax(regex: str) -> None:
    """Fast pre-check (Python's parser). Escapes Python lacks (`\\p{L}`, `\\z`) are left to the real compiler."""
    if not isinstance(regex, str):
        raise GrammarError(f"a regex must be a string, got {type(regex).__name__}")
    if regex == "":
        raise GrammarError("the regex is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. FutureWarning for POSIX classes such as [[:alpha:]]
            re.compile(regex)
    except re.error as exc:
        if "bad escape" not in str(exc):
            raise GrammarError(f"invalid regex {preview_regex(regex)}: {exc}") from None
    except (RecursionError, OverflowError) as exc:
        raise GrammarError(f"invalid regex {preview_regex(regex)}: {type(exc).__name__}") from None


def build_index(regex: str, vocabulary) -> object:
    from outlines_core import Index

    if regex == "":
        raise GrammarError("the regex is empty")
    try:
        return Index(regex, vocabulary)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"cannot compile regex {preview_regex(regex)}: {_explain(regex, first_line(exc))}") from None


def _explain(regex: str, message: str) -> str:
    """outlines-core drops the parser's detail from syntax errors; say something a user can act on."""
    if "error building NFA" in message:
        try:
            re.compile(regex)
        except re.error as exc:
            return f"invalid syntax: {exc}"
        except (RecursionError, OverflowError):
            pass
        return "syntax not supported here (look-arounds, backreferences and lazy or possessive tricks are not)"
    if "start state" in message:
        return "anchors and word boundaries (^, $, \\b) are not supported; the whole output always matches the regex"
    return message


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def preview_regex(regex: str, limit: int = 80) -> str:
    return repr(regex if len(regex) <= limit else regex[:limit] + "...")
