"""Per-choice latency as the client sees it, recorded into the gateway's metrics, and SLA
attainment (a choice meets the TTFT SLA, the TPOT SLA, or both: goodput).

Every clock here is the gateway's `time.perf_counter()`; a request's clock starts when its
first byte reaches the gateway (RequestIdMiddleware stamps it), so TTFT includes tokenizing,
routing and the attention server's queue, as a client measures it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from afd import metrics
from afd.config import check


@dataclass(frozen=True)
class SLA:
    """Targets in seconds; 0 means no target (every choice meets it)."""

    ttft_s: float = 0.0
    tpot_s: float = 0.05  # the Step-3 target: 20 tokens/s per request

    def __post_init__(self) -> None:
        check(self.ttft_s >= 0 and self.tpot_s >= 0, "SLA targets must be >= 0 (0: no target)")

    def met(self, ttft: float, tpot: float | None) -> tuple[bool, bool]:
        ttft_ok = not self.ttft_s or ttft <= self.ttft_s
        tpot_ok = not self.tpot_s or tpot is None or tpot <= self.tpot_s
        return ttft_ok, tpot_ok


class ChoiceTiming:
    """The timestamps of one choice's token events; `finish` records them once."""

    def __init__(self, t_arrival: float, sla: SLA):
        self.t_arrival = t_arrival
        self.sla = sla
        self.t_first: float | None = None
        self.t_last = 0.0
        self._queued = False

    def event(self, num_tokens: int, queue_seconds: float) -> None:
        """A token event arrived (queue_seconds: as the attention server reported it)."""
        now = time.perf_counter()
        if not self._queued:
            self._queued = True
            metrics.QUEUE_TIME.observe(max(0.0, queue_seconds))
        if not num_tokens:
            return
        if self.t_first is None:
            self.t_first = now
            metrics.TIME_TO_FIRST_TOKEN.observe(now - self.t_arrival)
        else:
            metrics.INTER_TOKEN_LATENCY.observe(now - self.t_last)
        self.t_last = now

    def finish(self, completion_tokens: int) -> None:
        now = time.perf_counter()
        metrics.E2E_LATENCY.observe(now - self.t_arrival)
        if self.t_first is None:  # finished without a token (e.g. max_tokens reached by a stop)
            return
        ttft = self.t_first - self.t_arrival
        tpot = None
        if completion_tokens > 1:
            tpot = (self.t_last - self.t_first) / (completion_tokens - 1)
            metrics.TIME_PER_OUTPUT_TOKEN.observe(tpot)
        ttft_ok, tpot_ok = self.sla.met(ttft, tpot)
        metrics.SLA_CHECKED.inc()
        if ttft_ok:
            metrics.SLA_TTFT_MET.inc()
        if tpot_ok:
            metrics.SLA_TPOT_MET.inc()
        if ttft_ok and tpot_ok:
            metrics.GOODPUT.inc()


def publish_sla(sla: SLA) -> None:
    """The targets as gauges, so dashboards can draw the SLA lines."""
    metrics.SLA_TTFT.set(sla.ttft_s)
    metrics.SLA_TPOT.set(sla.tpot_s)
