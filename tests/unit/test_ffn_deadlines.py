"""Deadlines learnt from each FFN replica's round trips (services/attention/deadlines.py): a
replica that stops answering while its connection stays up is marked down after its usual
answer time, not after the FFN timeout; a slow but live one (a long message) is not."""

from __future__ import annotations

import time

import pytest
import torch

from afd.errors import TransportError
from services.attention import deadlines
from services.attention.deadlines import RoundTripDeadlines
from tests.unit.test_ffn_failover import CFG, MOE, FakeFFN, pool

H = CFG.hidden_size


def test_the_limit_follows_the_p99_and_the_message_size():
    d = RoundTripDeadlines()
    assert d.limit("a", 32, 30.0) == 30.0  # nothing learnt yet: the fixed bound
    for _ in range(deadlines.MIN_SAMPLES):
        d.observe("a", 0.005, 32)
    assert d.limit("a", 32, 30.0) == deadlines.FLOOR_S  # 10 x p99 is under the floor
    assert d.limit("a", 4096, 30.0) == pytest.approx(10 * 0.005 * 128)  # 128 x the usual size
    assert d.limit("a", 4096, 5.0) == 5.0  # never past the fixed bound
    assert d.limit("b", 32, 30.0) == 30.0  # per peer
    for _ in range(deadlines.REFRESH):
        d.observe("a", 0.3, 32)  # the peer got slower: the p99 follows
    assert d.limit("a", 32, 30.0) == pytest.approx(3.0)


class SlowFFN(FakeFFN):
    """Answers each message after base_s + per_token_s x its tokens, or never when hung."""

    def __init__(self, address, value, base_s=0.002, per_token_s=0.0005):
        super().__init__(address, value)
        self.base_s, self.per_token_s = base_s, per_token_s
        self._due: list[tuple[float, object]] = []

    def send(self, req):
        self.sent.append(req)
        if self.mode == "hung":
            return True
        ready = time.monotonic() + self.base_s + self.per_token_s * req.num_tokens
        self._due.append((ready, self._answer(req)))
        return True

    def _recv(self, timeout):
        now = time.monotonic()
        for i, (ready, reply) in enumerate(self._due):
            if ready <= now:
                del self._due[i]
                return reply
        time.sleep(min(timeout, 0.001))
        return None


def _layer(p, tokens):
    x = torch.zeros(tokens, H)
    ids = torch.zeros(tokens, CFG.top_k, dtype=torch.int32)
    return p.collect(p.send(MOE, 0, x, ids, torch.ones(tokens, CFG.top_k)))


def _learnt_pool():
    """One shard, one replica answering 32-token messages in ~18 ms, with a 30 s FFN timeout,
    after enough round trips to know it."""
    p, (c,) = pool([1.0], timeout=30.0)
    slow = SlowFFN(c.address, 1.0)
    p.replicas.peers[0].client = slow
    for _ in range(deadlines.MIN_SAMPLES + 4):
        _layer(p, 32)
    return p, slow


def test_a_replica_that_stops_answering_is_down_after_its_usual_time_not_the_timeout():
    p, slow = _learnt_pool()
    slow.mode = "hung"  # connected, silent
    t0 = time.monotonic()
    # the floor, or a little over it where a busy box slowed the learnt round trips
    with pytest.raises(TransportError, match=r"within [2-9]\.\ds"):
        _layer(p, 32)
    assert time.monotonic() - t0 < 15  # the floor (2 s) on a busy box, never the 30 s timeout
    assert not p.replicas.peers[0].up


def test_a_long_message_to_a_slow_but_live_replica_is_waited_for():
    p, slow = _learnt_pool()
    t0 = time.monotonic()
    out = _layer(p, 4096)  # ~2.05 s on this replica: past the floor, within the scaled limit
    assert time.monotonic() - t0 > deadlines.FLOOR_S
    assert out.shape == (4096, H) and p.replicas.peers[0].up
