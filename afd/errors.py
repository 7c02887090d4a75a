"""Typed errors: each names the problem in words a user can act on."""


class AfdError(Exception):
    """Base of every error afd raises on purpose."""


class ConfigError(AfdError):
    """A model directory or config.json that afd cannot serve."""


class CheckpointError(AfdError):
    """Missing, malformed or mis-shaped weights."""


class RequestError(AfdError):
    """A request that cannot be served as asked (e.g. a prompt longer than the context)."""


class OverloadedError(RequestError):
    """The waiting queue is full: try again later (HTTP 429 with Retry-After)."""


class TransportError(AfdError):
    """A peer that did not answer within its deadline, or answered with an error."""
