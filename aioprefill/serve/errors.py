"""HTTP statuses for aioprefill's errors, and OpenAI's error object.

Shared by `aioprefill.serve` and the example servers (examples/serving.py): the one mapping from
the library's exception tree to a status. A client's mistake is a 4xx, never a 500: a 500 is
kept for a failure inside a forward or a worker that died.

| error | status | why |
| --- | --- | --- |
| `InvalidRequest` (bad prompt, bad option) | 400 | the request is wrong; the message says how |
| `HTTPError(401)` (no valid API key) | 401 | `serve/auth.py`; before the body is read |
| `HTTPError(413)` (body or prompt list too large) | 413 | as TEI does for a batch too large |
| `EngineOverloaded` (incl. `KVBudgetExceeded`) | 429 | retry later, like TEI's overloaded |
| `EngineClosed`, `WorkerStartFailed` | 503 | this server cannot serve now: routers go elsewhere |
| `DeadlineExceeded` | 504 | not dispatched in time: it never ran |
| `WorkerCrashed`, `ForwardFailed`, other | 500 | the server failed while running it |
"""

from __future__ import annotations

import msgspec

from aioprefill.errors import (
    AioprefillError,
    DeadlineExceeded,
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
    WorkerStartFailed,
)
from aioprefill.serve.schemas import ErrorBody, ErrorInfo

__all__ = ["HTTPError", "error_body", "error_status", "error_type"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class HTTPError(Exception):
    """A refusal decided by the HTTP layer itself (a malformed body, an unknown path, a body
    too large): its status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_status(exc: BaseException) -> int:
    """The HTTP status for `exc` (the table in this module's docstring)."""
    if isinstance(exc, HTTPError):
        return exc.status
    if isinstance(exc, InvalidRequest):
        return 400
    if isinstance(exc, EngineOverloaded):
        return 429
    if isinstance(exc, (EngineClosed, WorkerStartFailed)):
        return 503
    if isinstance(exc, DeadlineExceeded):
        return 504
    return 500


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


_encode = msgspec.json.Encoder().encode


def error_body(status: int, message: str) -> bytes:
    """`{"error": {"message", "type", "code", "param"}}` as JSON bytes."""
    info = ErrorInfo(message=message, type=error_type(status), code=status)
    return _encode(ErrorBody(error=info))


def is_client_error(exc: BaseException) -> bool:
    """True for what the caller caused (a 4xx), so the server logs it quietly."""
    return isinstance(exc, (HTTPError, AioprefillError)) and error_status(exc) < 500
