"""The errors of grammar compiles: a grammar that cannot be used, a compile too slow, a compile queue full, a backend
stopped. Importable without torch (the compile worker imports it)."""

from __future__ import annotations


class GrammarError(ValueError):
    """A regex or JSON schema that cannot be used for constrained decoding (bad syntax, too costly, ...)."""


class GrammarTimeoutError(GrammarError):
    """Compiling the grammar took longer than the backend's timeout."""


class GrammarBusyError(GrammarError):
    """Too many compiles are already waiting for a worker; the request may be retried later."""


class GrammarShutDownError(GrammarError):
    """The grammar backend stopped before the compile ran (not the grammar's fault)."""
