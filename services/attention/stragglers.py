"""Straggler detection over an attention server's FFN pool.

Every MoE layer goes to every FFN shard, so the whole pool waits for its slowest member: one
slow server sets the pace of every step. Each round trip's timing (see afd.metrics'
ROUNDTRIP_PARTS) is kept per peer over a sliding window; at every check a peer whose round-trip
p99 is above `factor` x the median round trip of the rest of the pool is suspect, and one that
stays suspect for `checks` consecutive checks is flagged, with a log line naming the part of
the round trip that makes the difference (attention send, network, FFN queue, FFN compute).

The reference leaves the peer itself out: in a pool of two, the median of all samples would be
pulled halfway towards the straggler and could never be exceeded by a factor of two.
Pure Python, no torch; called on the engine thread between steps.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from afd.config import check
from afd.metrics import ROUNDTRIP_PARTS

log = logging.getLogger("afd.attention.stragglers")

PART_NAMES = {
    "a2f_send": "attention send",
    "network": "network",
    "ffn_queue": "FFN queue",
    "ffn_compute": "FFN compute",
    "f2a_send": "FFN reply send",
}


@dataclass(frozen=True)
class StragglerConfig:
    factor: float = 2.0  # p99 above the rest of the pool's median by this factor ...
    checks: int = 3  # ... at this many consecutive checks
    window_s: float = 10.0  # samples older than this are forgotten
    interval_s: float = 1.0  # seconds between checks
    min_samples: int = 20  # a peer with fewer samples in the window is not judged
    max_samples: int = 4096  # per peer, newest kept

    def __post_init__(self) -> None:
        check(self.factor > 1.0, f"the straggler factor must be > 1, got {self.factor}")
        check(
            self.checks >= 1 and self.window_s > 0 and self.interval_s > 0,
            "straggler checks, window and interval must be positive",
        )


@dataclass(frozen=True)
class Verdict:
    """One peer at one check."""

    peer: str
    p99_s: float
    reference_s: float  # median round trip of the rest of the pool
    parts_s: tuple[float, ...]  # this peer's mean of each part, in ROUNDTRIP_PARTS order
    pool_parts_s: tuple[float, ...]  # the rest of the pool's means

    @property
    def ratio(self) -> float:
        return self.p99_s / self.reference_s if self.reference_s > 0 else math.inf

    @property
    def slow_part(self) -> str:
        """The part whose mean exceeds the rest of the pool's by the most."""
        excess = [p - q for p, q in zip(self.parts_s, self.pool_parts_s, strict=True)]
        return ROUNDTRIP_PARTS[max(range(len(excess)), key=excess.__getitem__)]

    def describe(self, cfg: StragglerConfig) -> str:
        ms = [
            f"{PART_NAMES[n]} {p * 1e3:.2f}/{q * 1e3:.2f}"
            for n, p, q in zip(ROUNDTRIP_PARTS, self.parts_s, self.pool_parts_s, strict=True)
        ]
        slow = self.slow_part
        i = ROUNDTRIP_PARTS.index(slow)
        return (
            f"FFN peer {self.peer} is a straggler: round-trip p99 {self.p99_s * 1e3:.2f} ms vs "
            f"the rest of the pool's median {self.reference_s * 1e3:.2f} ms (x{self.ratio:.1f} > "
            f"x{cfg.factor:g} for {cfg.checks} checks); mean ms this peer/rest: {', '.join(ms)}; "
            f"slow part: {PART_NAMES[slow]} "
            f"(+{(self.parts_s[i] - self.pool_parts_s[i]) * 1e3:.2f} ms)"
        )


@dataclass
class _PeerWindow:
    samples: deque = field(default_factory=deque)  # (t, round trip, parts)
    strikes: int = 0
    flagged: bool = False


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def _means(samples: Sequence[tuple[float, float, tuple[float, ...]]]) -> tuple[float, ...]:
    n = len(samples)
    return tuple(sum(s[2][i] for s in samples) / n for i in range(len(ROUNDTRIP_PARTS)))


class StragglerDetector:
    def __init__(self, cfg: StragglerConfig, peers: Sequence[str]):
        self.cfg = cfg
        self._peers = {p: _PeerWindow(deque(maxlen=cfg.max_samples)) for p in peers}
        self._next_check = 0.0
        self.last: dict[str, Verdict] = {}  # the latest verdict per judged peer

    def add(self, peer: str, t: float, roundtrip: float, parts: tuple[float, ...]) -> None:
        """One round trip of `peer` at monotonic time `t` (parts in ROUNDTRIP_PARTS order)."""
        w = self._peers.get(peer)
        if w is None:
            w = self._peers[peer] = _PeerWindow(deque(maxlen=self.cfg.max_samples))
        w.samples.append((t, roundtrip, parts))

    def flagged(self, peer: str) -> bool:
        w = self._peers.get(peer)
        return bool(w and w.flagged)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def maybe_check(self, now: float) -> bool:
        """Run a check if one is due; True if it ran."""
        if now < self._next_check:
            return False
        self._next_check = now + self.cfg.interval_s
        self.check(now)
        return True

    def check(self, now: float) -> None:
        cfg = self.cfg
        for w in self._peers.values():
            while w.samples and w.samples[0][0] < now - cfg.window_s:
                w.samples.popleft()
        judged = {p: w for p, w in self._peers.items() if len(w.samples) >= cfg.min_samples}
        if len(judged) < 2:
            return  # nothing to compare with: keep every flag as it is
        for peer, w in judged.items():
            rest = [s for p, o in judged.items() if p != peer for s in o.samples]
            v = Verdict(
                peer=peer,
                p99_s=_p99([s[1] for s in w.samples]),
                reference_s=statistics.median(s[1] for s in rest),
                parts_s=_means(w.samples),
                pool_parts_s=_means(rest),
            )
            self.last[peer] = v
            w.strikes = w.strikes + 1 if v.ratio > cfg.factor else 0
            if w.strikes >= cfg.checks and not w.flagged:
                w.flagged = True
                log.warning("%s", v.describe(cfg))
            elif w.strikes == 0 and w.flagged:
                w.flagged = False
                log.info(
                    "FFN peer %s is no longer a straggler (round-trip p99 %.2f ms, x%.1f)",
                    peer,
                    v.p99_s * 1e3,
                    v.ratio,
                )
