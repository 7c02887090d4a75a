"""The attention server's metrics, recorded on the engine thread after each step.

Each step returns its raw timing (`StepResult`: the FFN replies' traces, the attention times,
the step's token count) and the engine its load (`Stats`); this turns them into Prometheus
observations and feeds the straggler detector. Per step that is a few observe() calls per FFN
reply, with the metric children resolved once here, so the per-layer path itself carries only
its timestamps.
"""

from __future__ import annotations

import logging
import time

from afd import metrics
from afd.control import Stats
from afd.messages import Trace
from services.attention.engine import StepResult
from services.attention.stragglers import StragglerConfig, StragglerDetector

log = logging.getLogger("afd.attention")


def breakdown(tr: Trace) -> tuple[float, tuple[float, ...]]:
    """(round trip, its parts in metrics.ROUNDTRIP_PARTS order). Every difference is taken
    between two stamps of one host, so the hosts' clocks need not agree (StepMesh's way)."""
    roundtrip = max(0.0, tr.a_recv - tr.a_send)  # attention host
    ffn_queue = max(0.0, tr.f_compute_start - tr.f_recv)  # FFN host
    ffn_compute = max(0.0, tr.f_compute_end - tr.f_compute_start)
    f2a_send = max(0.0, tr.f_send - tr.f_compute_end)
    residence = max(0.0, tr.f_send - tr.f_recv)
    # StepMesh's net_cost: what the attention host waited that the FFN host cannot account for.
    outside = max(0.0, roundtrip - residence)
    # The FFN may have the message before the send call returns on the attention host; only
    # the part of the send that did not overlap the FFN's work is the attention host's own.
    a2f_send = min(max(0.0, tr.a_sent - tr.a_send), outside) if tr.a_sent else 0.0
    network = outside - a2f_send
    return roundtrip, (a2f_send, network, ffn_queue, ffn_compute, f2a_send)


class EngineTelemetry:
    def __init__(self, peers: list[str], stragglers: StragglerConfig | None = None):
        """`peers`: the FFN replicas' addresses the engine sends to."""
        self.detector = StragglerDetector(stragglers or StragglerConfig(), peers)
        self._preemptions: int | None = None  # the count last seen
        self._prefix = (0, 0)  # prefix-cache queries and hits last seen
        self._roundtrip: dict = {}
        self._parts: dict[str, tuple] = {}
        self._straggler: dict = {}
        for a in peers:
            self._add_peer(a)
        self._layer = metrics.ATTENTION_LAYER.labels()
        self._failed = False

    def _add_peer(self, addr: str) -> None:
        """Resolve a peer's metric children once (an elastic pool's members join later)."""
        self._roundtrip[addr] = metrics.FFN_ROUNDTRIP.labels(addr)
        self._parts[addr] = tuple(
            metrics.FFN_ROUNDTRIP_PART.labels(addr, part) for part in metrics.ROUNDTRIP_PARTS
        )
        self._straggler[addr] = metrics.STRAGGLER.labels(addr)
        self._straggler[addr].set(0)

    def after_step(self, result: StepResult, seconds: float, load: Stats) -> None:
        """After a step: its time, tokens, FFN round trips; then a straggler check if due."""
        try:
            self._after_step(result, seconds, load)
        except Exception:  # metrics must never take the engine down; say so once
            if not self._failed:
                self._failed = True
                log.exception("recording the step's metrics failed")

    def idle(self, load: Stats) -> None:
        """Between steps while idle: refresh the gauges (aborts change them too)."""
        self._gauges(load)
        metrics.FFN_PAUSED.set(0)  # nothing is held while nothing is to run

    def _after_step(self, result: StepResult, seconds: float, load: Stats) -> None:
        self._gauges(load)
        metrics.FFN_PAUSED.set(1 if result.paused else 0)
        if not result.tokens:
            return  # nothing was scheduled: no step to speak of
        timing = result.timing
        metrics.STEP_SECONDS.observe(seconds)
        metrics.STEP_TOKENS.observe(result.tokens)
        metrics.MICRO_BATCHES_IN_FLIGHT.set(timing.max_in_flight)
        drafted, draft_tokens, kept = result.drafts
        if drafted:
            metrics.SPEC_DRAFTS.inc(drafted)
            metrics.SPEC_DRAFT_TOKENS.inc(draft_tokens)
            metrics.SPEC_ACCEPTED_TOKENS.inc(kept)
            for i, n in enumerate(result.kept_at):
                metrics.SPEC_ACCEPTED_PER_POS.labels(str(i)).inc(n)
        for s in timing.attention_seconds:
            self._layer.observe(s)
        now = time.monotonic()
        for addr, reply in timing.traces:
            self._roundtrip_of(addr, now, *breakdown(reply.trace))
        for addr, stamps in timing.inline:  # layers run in one native call (stack.py)
            for start, attended, done in stamps.tolist():
                self._layer.observe(attended - start)
                # the experts were called, not sent: the whole round trip is their compute
                compute = done - attended
                self._roundtrip_of(addr, now, compute, (0.0, 0.0, 0.0, compute, 0.0))
        if self.detector.maybe_check(now):
            for addr, g in self._straggler.items():
                g.set(1 if self.detector.flagged(addr) else 0)

    def _roundtrip_of(self, addr: str, now: float, rt: float, parts: tuple[float, ...]) -> None:
        if addr not in self._roundtrip:
            self._add_peer(addr)  # joined an elastic pool
        self._roundtrip[addr].observe(rt)
        for h, v in zip(self._parts[addr], parts, strict=True):
            h.observe(v)
        self.detector.add(addr, now, rt, parts)

    def _gauges(self, load: Stats) -> None:
        metrics.NUM_RUNNING.set(load.running)
        metrics.NUM_WAITING.set(load.waiting)
        metrics.KV_USAGE.set(load.kv_usage)
        n = load.preemptions
        if self._preemptions is not None and n > self._preemptions:
            metrics.PREEMPTIONS.inc(n - self._preemptions)
        self._preemptions = n
        queries, hits = self._prefix
        metrics.PREFIX_QUERIES.inc(max(0, load.prefix_queries - queries))
        metrics.PREFIX_HITS.inc(max(0, load.prefix_hits - hits))
        self._prefix = (load.prefix_queries, load.prefix_hits)
