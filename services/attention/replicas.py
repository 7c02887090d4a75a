"""The FFN pool's membership: which servers hold which expert shard, which of them are up, and
how the ones marked down are probed back.

A shard may be served by several FFN servers (`--ffn a|b,c`: shard 0 on a or b, shard 1 on
c). A shard's messages go to its first live replica. A replica marked down (by the dispatcher,
when it did not answer in time, answered with an error of its own or could not take a
message) is probed with an empty message (non-blocking, between steps, backing off from 0.2 s
to 1 s) and taken back when it answers. Readiness is a ping of every live replica: false only
while some shard has no live replica. Sequence numbers are per replica, and a replica marked
down drops the replies still to come to what it was sent, so a late reply is never taken for
another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from afd.config import ModelConfig
from afd.errors import ConfigError, TransportError
from afd.messages import FFNRequest
from afd.sharding import ExpertShard
from afd.transport.base import FFNClient

log = logging.getLogger("afd.attention")

# First and longest wait between probes of a replica marked down. A probe of a peer with no
# connection costs nothing (it is refused locally), and requests may be paused for it.
_BACKOFF_S = (0.2, 1.0)
_PROBE_S = 2.0  # how long a probe may take (at most the FFN timeout)


@dataclass(eq=False)
class Peer:
    """One FFN server: a replica of one expert shard."""

    client: FFNClient
    shard: ExpertShard
    next_seq: int = 0
    outstanding: int = 0  # messages sent whose reply has not been collected
    up: bool = True
    reason: str = ""  # why it was marked down
    failures: int = 0  # probes failed in a row (backoff)
    retry_at: float = 0.0  # monotonic: when to probe it next while down
    probe: tuple[int, float] | None = None  # (seq, monotonic deadline) of the probe out

    @property
    def address(self) -> str:
        return self.client.address

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq


class Replicas:
    """Every replica of every expert shard, and whether each is up."""

    def __init__(self, cfg: ModelConfig, peers: list[Peer], timeout_s: float, failover_s: float):
        self.cfg = cfg
        self.peers = peers
        n = max((p.shard.index for p in peers), default=-1) + 1
        self.shards: list[list[Peer]] = [[p for p in peers if p.shard.index == i] for i in range(n)]
        if any(not reps for reps in self.shards):
            raise ConfigError("every expert shard needs at least one FFN server")
        self.timeout_s = timeout_s
        self.failover_s = failover_s  # one attempt's time before failover; 0: timeout / replicas
        # Called with (replica, why) when a replica is marked down: whoever has messages out
        # on it sends them elsewhere.
        self.on_down: Callable[[Peer, str], None] | None = None

    @property
    def all_up(self) -> bool:
        return all(p.up for p in self.peers)

    def uncovered(self) -> list[int]:
        """The shards with no live replica: no step can run until each has one again."""
        return [i for i, reps in enumerate(self.shards) if not any(p.up for p in reps)]

    def attempt_s(self, shard: int) -> float:
        """How long one replica of `shard` may take before its message goes to another."""
        if self.failover_s > 0:
            return min(self.failover_s, self.timeout_s)
        return self.timeout_s / len(self.shards[shard])

    def send(self, shard: int, message: FFNRequest, why: str) -> tuple[Peer, int]:
        """Send `message` to the first live replica of `shard` (numbered and given a deadline
        for that replica); returns (replica, seq). A replica that cannot take it is marked
        down and the next one tried; raises TransportError when none is left (`why`: what
        sent the message here again, for the error)."""
        replicas = self.shards[shard]
        for peer in replicas:
            if not peer.up:
                continue
            seq = peer.take_seq()
            now = time.time()
            req = replace(message, seq=seq, deadline=now + self.attempt_s(shard), t_send=now)
            if peer.client.send(req) is False:
                # the connection was lost between steps: named as gather names a loss
                self.mark_down(
                    peer,
                    f"FFN peer {peer.address} is gone (not connected when message {seq} was sent)",
                )
                continue
            peer.outstanding += 1
            return peer, seq
        if len(replicas) == 1:
            raise TransportError(
                why or f"FFN peer {replicas[0].address} is down: {replicas[0].reason}"
            )
        reasons = "; ".join(f"{p.address}: {p.reason}" for p in replicas)
        raise TransportError(
            f"{why + '; ' if why else ''}no live replica of FFN shard {shard} left ({reasons})"
        )

    def mark_down(self, peer: Peer, why: str) -> None:
        """Stop using a replica until a probe says it is back; what it held goes elsewhere
        (`on_down`)."""
        if not peer.up:
            return
        peer.up, peer.reason, peer.failures, peer.probe = False, why, 0, None
        peer.retry_at = time.monotonic() + _BACKOFF_S[0]
        peer.client.reset(below=peer.next_seq)  # its late replies must not be waited for
        peer.outstanding = 0
        log.warning("FFN peer %s marked down: %s", peer.address, why)
        if self.on_down is not None:
            self.on_down(peer, why)

    def reset(self) -> None:
        """Abandon the messages in flight (after an error): their replies are dropped."""
        for peer in self.peers:
            if peer.up:
                peer.client.reset(below=peer.next_seq)
                peer.outstanding = 0

    # ---- probes and readiness ---------------------------------------------------------------

    def maintain(self) -> None:
        """Probe the replicas marked down whose turn has come; never blocks. Runs on the
        engine thread between steps (and while idle)."""
        now = time.monotonic()
        for peer in self.peers:
            if peer.up:
                continue
            if peer.probe is not None:
                self._check_probe(peer, 0.0)
            elif now >= peer.retry_at:
                self._start_probe(peer)

    def _empty(self, peer: Peer, timeout: float) -> FFNRequest:
        """An empty message (no tokens) to `peer`, numbered."""
        k = self.cfg.top_k if self.cfg.is_moe(0) else 0
        return FFNRequest(
            layer=0,
            micro_batch=0,
            seq=peer.take_seq(),
            hidden=torch.empty(0, self.cfg.hidden_size, dtype=torch.bfloat16),
            scales=None,
            expert_ids=torch.empty(0, k, dtype=torch.int32),
            expert_weights=torch.empty(0, k),
            sender="attention",
            deadline=time.time() + timeout,
            t_send=time.time(),
        )

    def _start_probe(self, peer: Peer) -> None:
        timeout = min(_PROBE_S, self.timeout_s)
        req = self._empty(peer, timeout)
        if peer.client.try_send(req):
            peer.probe = (req.seq, time.monotonic() + timeout)
        else:
            self._probe_failed(peer, "not connected")

    def _check_probe(self, peer: Peer, wait: float) -> None:
        seq, until = peer.probe
        reply = peer.client.poll(seq, wait)
        if reply is not None and reply.ok:
            peer.up, peer.reason, peer.failures, peer.probe = True, "", 0, None
            peer.client.reset(below=peer.next_seq)
            log.info("FFN peer %s is back", peer.address)
        elif reply is not None:
            self._probe_failed(peer, f"{reply.error_code}: {reply.error}")
        elif time.monotonic() >= until:
            self._probe_failed(peer, "no reply to a probe")

    def _probe_failed(self, peer: Peer, why: str) -> None:
        peer.probe = None
        peer.failures += 1
        backoff = min(_BACKOFF_S[1], _BACKOFF_S[0] * 2**peer.failures)
        peer.retry_at = time.monotonic() + backoff
        log.debug("FFN peer %s still down (%s); next probe in %.1fs", peer.address, why, backoff)

    def ping(self, timeout: float) -> None:
        """Readiness: an empty message to every live replica (those that do not answer within
        `timeout` are marked down), and a look at the probes of those marked down (never
        waited for: a hung peer must not hold the engine at every readiness check); raises
        TransportError naming the shards left without a live replica."""
        for peer in self.peers:
            if not peer.up and peer.probe is not None:
                self._check_probe(peer, 0.0)
            if not peer.up and peer.probe is None:
                self._start_probe(peer)
        deadline = time.monotonic() + timeout
        sent = []
        for peer in self.peers:
            if peer.up:
                req = self._empty(peer, timeout)
                if peer.client.send(req) is False:
                    self.mark_down(peer, f"FFN peer {peer.address} is not connected")
                else:
                    sent.append((peer, req.seq))
        for peer, seq in sent:
            reply = peer.client.poll(seq, max(0.0, deadline - time.monotonic()))
            if reply is None:
                self.mark_down(peer, f"FFN peer {peer.address} did not reply within {timeout:.1f}s")
            elif not reply.ok:
                self.mark_down(peer, f"FFN peer {peer.address}: {reply.error}")
        for peer in self.peers:  # probes answered while the pings were out
            if not peer.up and peer.probe is not None:
                self._check_probe(peer, 0.0)
        down = self.uncovered()
        if down:
            raise TransportError(
                "; ".join(
                    f"FFN shard {i} has no live replica ("
                    + ", ".join(f"{p.address}: {p.reason}" for p in self.shards[i])
                    + ")"
                    for i in down
                )
            )

    def wait_ready(self, timeout: float, probe_s: float = 2.0) -> None:
        """Ping until every shard has a live replica (a send to a peer that is still starting
        is dropped); the other replicas are taken in by the probes as they come up."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.ping(probe_s)
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                self.reset()
                time.sleep(0.1)  # a peer not yet listening refuses at once: do not spin
