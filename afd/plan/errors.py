"""The planner's one error type: bad input it can name in words (unknown hardware, bad SLA...)."""

from afd.errors import AfdError


class PlanError(AfdError):
    """Input the planner cannot work with; the message says what to change."""
