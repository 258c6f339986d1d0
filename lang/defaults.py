"""The process-wide default backend, and turning what a user passes as `backend=` into a Backend."""

from __future__ import annotations

import threading
from typing import Any, Optional

from braid.backends.base import Backend
from braid.errors import NoBackendError, ProgramError

_lock = threading.Lock()
_default_backend: Optional[Backend] = None


def as_backend(obj: Any) -> Backend:
    """A Backend, or an object holding one as `.endpoint` (braid.Runtime)."""
    if isinstance(obj, Backend):
        return obj
    endpoint = getattr(obj, "endpoint", None)
    if isinstance(endpoint, Backend):
        return endpoint
    raise ProgramError(f"not a braid backend: {obj!r} (use RuntimeEndpoint, Runtime, LocalEngine or OpenAI)")


def set_default_backend(backend: Any) -> None:
    global _default_backend
    with _lock:
        _default_backend = None if backend is None else as_backend(backend)


def get_default_backend() -> Optional[Backend]:
    return _default_backend


def resolve_backend(backend: Any = None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise NoBackendError("no backend: pass backend=... or call braid.set_default_backend(...) first")
    return _default_backend
