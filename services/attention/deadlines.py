"""How long one FFN replica may take to answer one message, learnt from its round trips.

A peer that hangs while its connection stays up (a gRPC peer stopped by SIGSTOP, an FFN server
whose compute thread is stuck while ZeroMQ's I/O thread still answers heartbeats) is noticed
only by a deadline. `--ffn-timeout` is a fixed bound sized for the worst step; this learns the
usual one per peer: FACTOR x the p99 of its recent round trips, scaled by the message's size
against the median size seen (a long prefill chunk gets proportionally longer: round trips grow
at most linearly with tokens, and less while weight reads dominate), never under FLOOR_S and
never over the attempt time `--ffn-timeout` gives. Until a peer has MIN_SAMPLES round trips
the fixed bound alone applies.

A deadline that fires on a slow but live peer costs little: the replica is marked down, its
messages go to another replica, or the engine pauses until a probe finds it answering.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

FACTOR = 10.0
FLOOR_S = 2.0
MIN_SAMPLES = 16
WINDOW = 512  # round trips kept per peer
REFRESH = 64  # new round trips between recomputations of a peer's p99 and median size


@dataclass
class _Peer:
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    since_refresh: int = 0
    p99_s: float = 0.0
    median_tokens: float = 1.0


class RoundTripDeadlines:
    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}

    def observe(self, peer: str, seconds: float, tokens: int) -> None:
        """One answered round trip of `tokens` tokens to `peer`."""
        p = self._peers.setdefault(peer, _Peer())
        p.samples.append((seconds, max(tokens, 1)))
        p.since_refresh += 1
        if p.since_refresh >= REFRESH or (len(p.samples) == MIN_SAMPLES and not p.p99_s):
            p.since_refresh = 0
            rtts = sorted(s for s, _ in p.samples)
            sizes = sorted(n for _, n in p.samples)
            p.p99_s = rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))]
            p.median_tokens = float(sizes[len(sizes) // 2])

    def limit(self, peer: str, tokens: int, bound: float) -> float:
        """Seconds `peer` may take for a message of `tokens` tokens, at most `bound`."""
        p = self._peers.get(peer)
        if p is None or not p.p99_s:
            return bound
        scale = max(1.0, tokens / p.median_tokens)
        return min(bound, max(FLOOR_S, FACTOR * p.p99_s * scale))
