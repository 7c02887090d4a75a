"""FFN replicas in the attention server's pool: failover within the deadline, replicas marked
down and probed back, late replies of a replica given up on never taken for others, readiness
false only while a shard has no live replica.

The assertions are on the mechanism (which deadline fired, what was sent where and in which
order), never on a narrow clock window: a loaded 2-core box may run any step late."""

import collections
import time

import pytest
import torch

from afd.config import ModelConfig
from afd.demo import TINY_CONFIG
from afd.errors import TransportError
from afd.messages import FFNReply
from afd.sharding import ExpertShard
from afd.transport.base import FFNClient
from services.attention import replicas
from services.attention.dispatch import FFNDispatcher
from services.attention.replicas import Peer, Replicas

CFG = ModelConfig.from_dict(TINY_CONFIG)
MOE = 1  # TINY_CONFIG's only MoE layer: every shard gets a part
H = CFG.hidden_size


class FakeFFN(FFNClient):
    """An FFN server whose behaviour a test switches: ok | hung | refuse | error | bad."""

    def __init__(self, address, value):
        super().__init__(address)
        self.value, self.mode = value, "ok"
        self.sent, self.held = [], []  # every request; requests a hung server sits on
        self._out = collections.deque()

    def _answer(self, req, code=""):
        out = None if code else torch.full((req.num_tokens, H), self.value, dtype=torch.bfloat16)
        return FFNReply(req.seq, req.layer, req.micro_batch, out, code, code and "boom")

    def send(self, req):
        self.sent.append(req)
        if self.mode == "refuse":
            return False
        if self.mode == "hung":
            self.held.append(req)
        else:
            code = {"ok": "", "error": "internal", "bad": "bad_value"}[self.mode]
            self._out.append(self._answer(req, code))
        return True

    def wake(self):
        """A hung server resumes: it answers everything it sat on (late)."""
        self._out.extend(self._answer(r) for r in self.held)
        self.held.clear()
        self.mode = "ok"

    def _recv(self, timeout):
        if self._out:
            return self._out.popleft()
        time.sleep(min(timeout, 0.002))
        return None


def pool(*shards, timeout=1.0):
    """shards: a list of replica values per shard."""
    peers, clients = [], []
    for i, values in enumerate(shards):
        for j, v in enumerate(values):
            c = FakeFFN(f"fake://{i}.{j}", v)
            clients.append(c)
            peers.append(Peer(c, ExpertShard(i, len(shards), CFG.num_experts)))
    pool = Replicas(CFG, peers, timeout, failover_s=0.0)
    return FFNDispatcher(CFG, pool, "bf16", torch.float32), clients


def step(p, tokens=3, mb=0):
    x = torch.zeros(tokens, H)
    ids = torch.zeros(tokens, CFG.top_k, dtype=torch.int32)
    w = torch.ones(tokens, CFG.top_k)
    return p.send(MOE, mb, x, ids, w)


def test_a_hung_replica_fails_over_within_the_deadline_and_is_marked_down():
    p, (a, b, c) = pool([1.0, 1.0], [2.0], timeout=1.0)
    a.mode = "hung"
    t0 = time.monotonic()
    out = p.collect(step(p))
    took = time.monotonic() - t0
    assert torch.all(out == 3.0)  # shard 0 (from b) + shard 1
    # a's attempt time (half the deadline: two replicas) fired, then b answered in time
    assert "did not reply to message 0 within 0.5s" in p.replicas.peers[0].reason
    assert not p.replicas.peers[0].up and took >= 0.5
    assert [r.seq for r in b.sent] == [0]
    n = len(a.sent)
    assert torch.all(p.collect(step(p)) == 3.0)
    assert len(a.sent) == n  # a is skipped while down


def test_a_replica_that_refuses_or_errs_fails_over_at_once():
    for mode, why in (("refuse", "not connected"), ("error", "internal: boom")):
        p, (a, b) = pool([1.0, 5.0])
        a.mode = mode
        t0 = time.monotonic()
        assert torch.all(p.collect(step(p)) == 5.0)
        peer = p.replicas.peers[0]
        # a failed on its own (no attempt time waited out); generous bound: the attempt time
        assert not peer.up and why in peer.reason and "within" not in peer.reason
        assert time.monotonic() - t0 < p.replicas.attempt_s(0)


def test_a_bad_message_is_an_error_not_a_failover():
    p, (a, b) = pool([1.0, 5.0])
    a.mode = "bad"
    with pytest.raises(TransportError, match="bad_value"):
        p.collect(step(p))
    assert p.replicas.peers[0].up and not b.sent


def test_every_message_in_flight_on_a_failed_replica_is_sent_again():
    p, (a, b) = pool([1.0, 5.0], timeout=1.0)
    a.mode = "hung"
    first, second = step(p, mb=0), step(p, mb=1)  # S = 2: two micro-batches out on a
    assert torch.all(p.collect(first) == 5.0)
    # both went to b the moment a was marked down, before anyone waited for the second
    assert [r.micro_batch for r in b.sent] == [0, 1]
    assert torch.all(p.collect(second) == 5.0)
    assert len(b.sent) == 2


def test_late_replies_of_a_replica_marked_down_are_never_taken():
    p, (a, b) = pool([1.0, 5.0], timeout=1.0)
    a.mode = "hung"
    p.collect(step(p))
    a.wake()  # a answers its old messages, with seq numbers b uses too
    a.mode = "hung"
    for _ in range(3):
        assert torch.all(p.collect(step(p)) == 5.0)
    a.drain()
    assert a.buffered == 0  # dropped on arrival, not kept to be matched


def test_a_replica_marked_down_is_probed_and_taken_back(monkeypatch):
    monkeypatch.setattr(replicas, "_BACKOFF_S", (0.05, 0.1))
    p, (a, b) = pool([1.0, 5.0], timeout=1.0)
    a.mode = "refuse"
    p.collect(step(p))
    assert not p.replicas.peers[0].up
    deadline = time.monotonic() + 10
    while not p.replicas.peers[0].up and time.monotonic() < deadline:
        p.replicas.maintain()  # the engine loop calls this between steps and while idle
        time.sleep(0.02)
        if len(a.sent) >= 3:
            a.mode = "ok"  # back after a few refused probes
    assert p.replicas.peers[0].up
    assert torch.all(p.collect(step(p)) == 1.0)  # the first replica is preferred again


def test_no_live_replica_is_a_fast_typed_error_then_readiness_recovers():
    p, (a, b, c) = pool([1.0, 1.0], [2.0], timeout=0.5)
    c.mode = "hung"
    with pytest.raises(TransportError, match="did not reply"):
        p.collect(step(p))
    p.reset()
    n = len(c.sent)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="FFN peer fake://1.0 is down"):
        p.collect(step(p))  # fails at once: no waiting on a peer known to be down
    assert len(c.sent) == n  # nothing was sent to it
    assert time.monotonic() - t0 < p.replicas.timeout_s  # generous: no deadline waited out
    p.reset()
    with pytest.raises(TransportError, match="FFN shard 1 has no live replica"):
        p.replicas.ping(0.2)
    c.wake()
    p.replicas.ping(0.2)  # the probe sent by ping is answered: shard 1 is covered again
    assert torch.all(p.collect(step(p)) == 3.0)


def test_readiness_holds_while_each_shard_keeps_one_replica():
    p, (a, b, c) = pool([1.0, 1.0], [2.0])
    a.mode = "refuse"
    p.replicas.ping(0.2)  # shard 0 still has b
    assert [peer.up for peer in p.replicas.peers] == [False, True, True]
    b.mode = "refuse"
    with pytest.raises(TransportError, match="FFN shard 0 has no live replica"):
        p.replicas.ping(0.2)
