"""An expert shard served inline in the attention process (afd serve's one-process topology)
is called, not sent to: the dispatcher computes the layer when it is sent, the reply carries a
full trace for the telemetry, the FFN metrics count it, and a failed compute fails the step
with its cause while the next step runs. A threaded in-process listener (S >= 2 micro-batches)
and network peers keep the message path."""

import itertools

import pytest
import torch

from afd import metrics
from afd.config import ModelConfig
from afd.demo import TINY_CONFIG
from afd.errors import TransportError
from afd.sharding import ExpertShard
from afd.transport import inproc
from afd.transport.serving import FFNServing
from afd.wire import WireLimits
from services.attention.dispatch import FFNDispatcher
from services.attention.replicas import Peer, Replicas

CFG = ModelConfig.from_dict(TINY_CONFIG)
MOE = next(i for i in range(CFG.num_layers) if CFG.is_moe(i))
H = CFG.hidden_size
LIMITS = WireLimits(H, CFG.num_layers, CFG.num_experts, 64, CFG.top_k)
_names = itertools.count()


class Shard:
    """A compute function that records its calls and can be told to fail."""

    def __init__(self, value: float):
        self.value, self.calls, self.fail = value, [], None

    def __call__(self, layer, reqs):
        self.calls.append((layer, len(reqs)))
        if self.fail == "raise":
            raise RuntimeError("boom")
        rows = reqs[0].num_tokens + (1 if self.fail == "shape" else 0)
        return [torch.full((rows, H), self.value)]


@pytest.fixture
def served():
    """(dispatcher, shards, listeners) factory: one inproc listener per shard value."""
    made = []

    def make(*values, inline=True):
        shards, peers, listeners = [], [], []
        for i, v in enumerate(values):
            addr = f"inproc://direct-{next(_names)}"
            shard = Shard(v)
            listeners.append(inproc.listen(addr, FFNServing(shard, LIMITS), inline=inline))
            shards.append(shard)
            peers.append(Peer(inproc.connect(addr), ExpertShard(i, len(values), CFG.num_experts)))
        made.extend(listeners)
        pool = Replicas(CFG, peers, timeout_s=5.0, failover_s=0.0)
        return FFNDispatcher(CFG, pool, "fp32", torch.float32), shards

    yield make
    for lst in made:
        lst.close()


def send(d: FFNDispatcher, tokens=3):
    x = torch.zeros(tokens, H)
    ids = torch.zeros(tokens, CFG.top_k, dtype=torch.int32)
    return d.send(MOE, 0, x, ids, torch.ones(tokens, CFG.top_k))


def _count(metric) -> float:
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith("_total"))


def test_an_inline_shard_is_computed_at_send_with_a_full_trace(served):
    d, (a, b) = served(1.0, 2.0)
    d.begin_step()
    before = _count(metrics.FFN_MESSAGES)
    pending = send(d)
    assert a.calls == [(MOE, 1)] and b.calls == [(MOE, 1)]  # computed before collect
    assert all(p.reply is not None for p in pending.parts)
    assert d.replicas.peers[0].next_seq == 0  # no message was numbered or queued
    assert torch.all(d.collect(pending) == 3.0)  # the shards' partial outputs summed
    assert _count(metrics.FFN_MESSAGES) == before  # recorded in batches,
    d.count_routed(flush=True)  # and when the engine runs out of work
    assert _count(metrics.FFN_MESSAGES) == before + 2
    (addr, reply), _ = d.timing.traces
    tr = reply.trace
    assert addr == d.replicas.peers[0].address
    assert tr.a_send <= tr.f_compute_start <= tr.f_compute_end <= tr.a_recv
    assert tr.a_sent == tr.a_send  # no send of its own: no a2f_send share


def test_a_failed_inline_compute_fails_the_step_with_its_cause_and_the_next_step_runs(served):
    for fail, why in (("raise", "RuntimeError: boom"), ("shape", "output (4, ")):
        d, (a,) = served(1.0)
        a.fail = fail
        d.begin_step()
        with pytest.raises(TransportError, match=r"failed layer \d+: internal: ") as err:
            send(d)
        assert why in str(err.value)
        d.reset()
        a.fail = None
        d.begin_step()
        assert torch.all(d.collect(send(d)) == 1.0)
        assert d.replicas.peers[0].up  # nothing to fail over to; the shard stays in use


def test_a_threaded_listener_keeps_the_message_path(served):
    d, (a,) = served(1.0, inline=False)
    d.begin_step()
    pending = send(d)
    assert d.replicas.peers[0].next_seq == 1  # numbered and queued to the listener's thread
    assert torch.all(d.collect(pending) == 1.0) and a.calls == [(MOE, 1)]


def test_expert_load_is_added_in_batches_of_steps_and_when_the_work_runs_out(served):
    d, _ = served(1.0)
    for step in range(3):
        d.begin_step()
        d.collect(send(d, tokens=2))  # 2 tokens x top_k pairs, all on expert 0
        d.count_routed(flush=step == 2)
        counted = int(d.expert_load[MOE, 0])
        assert counted == (3 * 2 * CFG.top_k if step == 2 else 0)
    d.begin_step()
    send(d)  # a step that did not complete (no count_routed) is never counted
    d.begin_step()
    d.count_routed(flush=True)
    assert int(d.expert_load.sum()) == 3 * 2 * CFG.top_k
