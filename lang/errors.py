"""Exceptions raised by the language and its backends.

Anything a user can cause (a bad argument, a feature the chosen backend lacks, a request the server
rejected) is a ValueError subclass so callers can catch it alongside other input errors.
"""

from __future__ import annotations

from typing import Optional


class BraidError(Exception):
    """Base of every braid error."""


class ProgramError(BraidError, ValueError):
    """A program used the language wrongly (bad argument, unknown variable, misplaced role...)."""


class NoBackendError(ProgramError):
    """run() was called without a backend and no default backend is set."""


class UnsupportedFeatureError(ProgramError):
    """The backend does not declare the capability a node needs."""

    def __init__(self, backend_name: str, capability: str, needed_by: Optional[str] = None):
        where = f" (needed by {needed_by})" if needed_by else ""
        super().__init__(f"backend {backend_name} does not support '{capability}'{where}")
        self.backend_name = backend_name
        self.capability = capability


class BackendRequestError(BraidError, ValueError):
    """The backend rejected a request as invalid (HTTP 4xx); `status` and the server's message kept."""

    def __init__(self, message: str, status: Optional[int] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.param = param


class BackendError(BraidError, RuntimeError):
    """The backend failed (connection refused, HTTP 5xx, malformed answer)."""


class ServerStartError(BraidError, RuntimeError):
    """A spawned server process died or did not become healthy in time."""
