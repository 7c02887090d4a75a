"""OpenAI-style errors: every failure the gateway reports is an `APIError`, rendered as
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from __future__ import annotations

from typing import Any

import grpc

from afd.errors import ErrorCode


class APIError(Exception):
    """An error the client gets, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class PeerUnavailable(APIError):
    """An attention server that could not be reached (its process is gone or the connection
    broke), as opposed to one that answered with an error of its own: the balancer marks it
    down, and a choice that got nothing from it yet may go to another server."""

    def __init__(self, message: str):
        super().__init__(503, message, "service_unavailable", None, "unavailable")


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400: the request cannot be served as asked."""
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, "unavailable")


def starting(message: str) -> APIError:
    """A 503 while no attention server has been ready yet: the cluster is still starting."""
    return APIError(503, message, "service_unavailable", None, "starting", {"Retry-After": "1"})


def overloaded(message: str) -> APIError:
    # Retry-After: the waiting queue drains in seconds on any sane deployment.
    return APIError(429, message, "rate_limit_error", None, "overloaded", {"Retry-After": "1"})


def internal(message: str) -> APIError:
    return APIError(500, message, "internal_error", None, "internal_error")


def rpc_error(e: grpc.aio.AioRpcError, address: str) -> APIError:
    """A failed call as the error the HTTP client sees."""
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, f"attention server {address} did not answer in time", "timeout")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, f"attention server {address} is overloaded", "rate_limit_error")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        # Not reachable, or its process went away mid-call (server-side cancel at shutdown).
        return PeerUnavailable(f"attention server {address} is unavailable ({code.name})")
    return unavailable(f"attention server {address} is unavailable ({code.name})")


def from_attention(code: ErrorCode, message: str) -> APIError:
    """An attention server's failed request as the HTTP client's error: the one place where
    an `ErrorCode` becomes an HTTP status."""
    make = _BY_CODE.get(code)
    if make is None:
        return internal(message or "the attention server failed the request")
    return make(message)


_BY_CODE = {
    ErrorCode.INVALID_REQUEST: invalid,
    ErrorCode.UNAVAILABLE: unavailable,
    ErrorCode.OVERLOADED: overloaded,
}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence (and the offending parameter) from pydantic's error list."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    # pydantic names each union branch it tried ("prompt.list[int]"): keep only real names.
    loc = [str(p) for p in first.get("loc", ()) if isinstance(p, int) or str(p).isidentifier()]
    param = ".".join(loc) or None
    if param and param.split(".")[0] == "prompt" and len(errors) > 1:
        return PROMPT_SHAPES, "prompt"
    msg = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else msg + more), param


PROMPT_SHAPES = (
    "prompt must be a non-empty string, a list of strings, a list of token ids (ints >= 0), "
    "or a list of lists of token ids"
)
