"""OpenAI-style error objects and the mapping from in-process exceptions to HTTP statuses."""

from __future__ import annotations

from typing import Any, Optional

from braid.runtime.error_kind import ErrorKind


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, status: int = 400, *, type: Optional[str] = None,
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.headers = headers
        self.message = message
        self.status = status
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "internal_server_error"
    return "invalid_request_error"


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(message, 400, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model '{model}' does not exist", 404, param="model", code="model_not_found")


def body_too_large(limit: int) -> APIError:
    return APIError(f"Request body is larger than the limit of {limit} bytes", 413, code="request_too_large")


def retry_later(message: str, param: Optional[str] = None, retry_after_s: int = 1) -> APIError:
    return APIError(message, 429, param=param, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


def too_many_requests(limit: int, retry_after_s: int = 1) -> APIError:
    return retry_later(f"The server has {limit} requests queued (--max-queued-requests); retry later",
                       retry_after_s=retry_after_s)


def unauthorized() -> APIError:
    return APIError("Invalid or missing API key (expected 'Authorization: Bearer <key>')", 401, code="invalid_api_key")


def unavailable(message: str) -> APIError:
    return APIError(message, 503, code="unavailable")


def internal(message: str) -> APIError:
    return APIError(message, 500, code="internal_error")


def for_kind(kind: ErrorKind, message: str, param: Optional[str] = None) -> APIError:
    """What the client gets for a request the scheduler refused or aborted with `kind`: the request's or its grammar's
    fault a 400 (invalid_request_error), the grammar compile queue full a 429 with Retry-After (rate_limit_error), a
    bug a 500 (internal_server_error)."""
    if kind in (ErrorKind.INVALID_REQUEST, ErrorKind.GRAMMAR_INVALID):
        return bad_request(message, param=param)
    if kind == ErrorKind.GRAMMAR_BUSY:
        return retry_later(message, param=param)
    return internal(message)


def from_exception(exc: BaseException) -> APIError:
    """User-caused exceptions (ValueError subclasses) become 400s; anything else is a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param=getattr(exc, "param", None))
    return internal(f"{type(exc).__name__}: {exc}")


def json_type(value: Any) -> str:
    """A value's JSON type as an error message names it ("a string", "an object", "null")."""
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def asks_for_nothing(value: Any, off_values: tuple) -> bool:
    """Whether a parameter's value asks for nothing: null, or one of `off_values` (a boolean matches only a
    boolean: 0 is no `false`)."""
    return value is None or any(value == off and isinstance(value, bool) == isinstance(off, bool)
                                for off in off_values)
