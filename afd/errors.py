"""Typed errors: each names the problem in words a user can act on, and carries the one
error code (`ErrorCode`) that the engine, the control plane and the gateway all speak."""

from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request failed, as every boundary names it: the engine sets it, the control plane
    carries it (control.proto ErrorCode), the gateway answers with its HTTP status."""

    NONE = ""
    INVALID_REQUEST = "invalid_request"  # HTTP 400: cannot be served as asked
    UNAVAILABLE = "unavailable"  # HTTP 503: the FFN pool is down or draining
    OVERLOADED = "overloaded"  # HTTP 429: the waiting queue is full
    INTERNAL = "internal"  # HTTP 500


class AfdError(Exception):
    """Base of every error afd raises on purpose."""

    code = ErrorCode.INTERNAL  # what a request that hit it is told


class ConfigError(AfdError):
    """A model directory, config.json, flag or config value that afd cannot serve with."""


class CheckpointError(AfdError):
    """Missing, malformed or mis-shaped weights."""


class DeviceMemoryError(AfdError):
    """A step needed more device memory than was left: its requests fail, the server goes on."""


class RequestError(AfdError):
    """A request that cannot be served as asked (e.g. a prompt longer than the context)."""

    code = ErrorCode.INVALID_REQUEST


class OverloadedError(RequestError):
    """The waiting queue is full: try again later (HTTP 429 with Retry-After)."""

    code = ErrorCode.OVERLOADED


class TransportError(AfdError):
    """A peer that did not answer within its deadline, or answered with an error."""

    code = ErrorCode.UNAVAILABLE


def check(ok: bool, problem: str) -> None:
    """A config dataclass's own validation: one ConfigError naming the bad value."""
    if not ok:
        raise ConfigError(problem)
