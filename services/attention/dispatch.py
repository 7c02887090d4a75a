"""Dispatch of one layer's FFN work to the FFN pool and reduction of the partial outputs.

Every peer holds one expert shard. A MoE layer's tokens go to every shard that holds one of
their experts (shard 0 always, for the shared expert); a dense layer goes to shard 0 alone.
The partial outputs are summed in float32 and returned in the compute dtype.

The pool also keeps the timing of the step in progress (read by the telemetry after it):
`traces` holds every reply with its round-trip stamps, `attention_seconds` the engine thread's
own work between pool calls (attention, router and quantization of one layer of one
micro-batch: the loop is collect -> attention -> send), `max_in_flight` the most micro-batches
with FFN work outstanding at once. While a reply is awaited and other messages are out, every
peer is polled about once a millisecond, so each reply's arrival stamp (trace.a_recv) is within
that of its arrival rather than of the moment the engine got round to it.

Replicas and failover: a shard may be served by several FFN servers (`--ffn a|b,c`: shard 0 on
a or b, shard 1 on c). A shard's messages go to its first live replica. A replica that does not
reply within its attempt time (the FFN timeout split between the shard's replicas, or
`failover_s`), answers with an error of its own, or cannot take a message is marked down; every
message it held is sent again to another live replica of the shard, within the same deadline,
so no request is lost while one replica is left. A replica marked down is probed with an empty
message (non-blocking, between steps, backing off from 0.2 s to 2 s) and taken back when it
answers. Sequence numbers are per replica, and replies to messages sent before a replica was
marked down are dropped on arrival, so a late reply is never taken for another.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from afd.config import ModelConfig
from afd.errors import TransportError
from afd.messages import FFNReply, FFNRequest
from afd.quant import quantize_fp8
from afd.sharding import ExpertShard
from afd.transport.base import FFNClient

log = logging.getLogger("afd.attention")

_WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SWEEP_S = 0.001  # while several replies are out: how often every peer is polled
_BACKOFF_S = (0.2, 2.0)  # first and longest wait between probes of a replica marked down
_PROBE_S = 2.0  # how long a probe may take (at most the FFN timeout)
# Errors that say our message was bad: another replica would refuse it too, so no failover.
_MESSAGE_ERRORS = ("bad_request", "bad_header", "bad_version", "bad_size", "bad_value")


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


@dataclass(eq=False)
class _Part:
    """One shard's share of one (layer, micro-batch): the replica it is on now, and the
    message to send again if that replica fails."""

    shard: int
    message: FFNRequest  # seq, deadline and t_send are set per attempt
    peer: Peer | None = None
    seq: int = -1
    sent: float = 0.0  # time.time() when the send call returned
    started: float = 0.0  # monotonic: when the current attempt began
    reply: FFNReply | None = None


@dataclass(eq=False)
class Pending:
    """What is in flight for one (layer, micro-batch): one part per shard it needs."""

    parts: list[_Part]
    num_tokens: int


class FFNPool:
    def __init__(
        self,
        cfg: ModelConfig,
        peers: list[Peer],
        a2f_dtype: str,
        compute_dtype: torch.dtype,
        timeout_s: float,
        sender: str = "attention",
        failover_s: float = 0.0,
    ):
        if a2f_dtype not in ("fp8", *_WIRE):
            raise ValueError(f"a2f dtype must be fp8, bf16 or fp32, got {a2f_dtype!r}")
        self.cfg = cfg
        self.peers = peers  # every replica of every shard
        n = max((p.shard.index for p in peers), default=-1) + 1
        self.shards: list[list[Peer]] = [[p for p in peers if p.shard.index == i] for i in range(n)]
        if any(not reps for reps in self.shards):
            raise ValueError("every expert shard needs at least one FFN server")
        self.failover_s = failover_s  # one attempt's time before failover; 0: timeout / replicas
        self._open: list[_Part] = []  # parts sent whose reply has not been taken
        self.a2f_dtype = a2f_dtype
        self.dtype = compute_dtype
        self.timeout_s = timeout_s
        self.sender = sender
        self.traces: list[tuple[str, FFNReply]] = []  # (peer address, reply) of the last step
        self.attention_seconds: list[float] = []  # engine-thread work between pool calls
        self.max_in_flight = 0
        self._in_flight = 0
        self._idle_since = 0.0  # perf_counter() when the pool last returned; 0: step start

    def begin_step(self) -> None:
        """Forget the previous step's timing; probe replicas that are due."""
        self.maintain()
        self.traces.clear()
        self.attention_seconds.clear()
        self.max_in_flight = self._in_flight = 0
        self._idle_since = 0.0

    def send(
        self,
        layer: int,
        micro_batch: int,
        x: torch.Tensor,  # [T, H] compute dtype
        ids: torch.Tensor,  # [T, k] int32
        weights: torch.Tensor,  # [T, k] float32
    ) -> Pending:
        if self.a2f_dtype == "fp8":
            hidden, scales = quantize_fp8(x)  # [T, H] fp8, [T] f32
        else:
            hidden, scales = x.to(_WIRE[self.a2f_dtype]), None
        if self._idle_since:
            self.attention_seconds.append(time.perf_counter() - self._idle_since)
        message = FFNRequest(
            layer=layer,
            micro_batch=micro_batch,
            seq=0,
            hidden=hidden,
            scales=scales,
            expert_ids=ids,
            expert_weights=weights,
            sender=self.sender,
        )
        parts = []
        for shard, replicas in enumerate(self.shards):
            if not self.cfg.is_moe(layer) and not replicas[0].shard.owns_dense:
                continue
            part = _Part(shard, message)
            self._assign(part, "")
            parts.append(part)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        self._idle_since = time.perf_counter()
        return Pending(parts, x.shape[0])

    def collect(self, pending: Pending) -> torch.Tensor:  # [T, H] compute dtype
        self._gather(pending)
        total: torch.Tensor | None = None
        out: torch.Tensor | None = None
        for part in pending.parts:
            reply = part.reply
            assert reply is not None and part.peer is not None
            tr = reply.trace
            stamped = replace(tr, a_sent=part.sent, a_recv=tr.a_recv or time.time())
            self.traces.append((part.peer.address, replace(reply, trace=stamped)))
            out = reply.output
            if len(pending.parts) > 1:
                total = out.float() if total is None else total.add_(out.float())
        self._in_flight -= 1
        self._idle_since = time.perf_counter()
        if total is None:
            assert out is not None
            return out.to(self.dtype)
        return total.to(self.dtype)

    def _gather(self, pending: Pending) -> None:
        """Every part's reply (part.reply), failing over to another replica of its shard when
        one does not answer within its attempt time; raises TransportError when a shard has
        no live replica left or the deadline passes."""
        parts = pending.parts
        start = time.monotonic()
        deadline = start + self.timeout_s
        while True:
            if len(self.peers) > 1:
                for peer in self.peers:
                    if peer.up and peer.outstanding > peer.client.buffered:
                        peer.client.drain()
            for part in parts:
                if part.reply is None:
                    reply = part.peer.client.poll(part.seq)
                    if reply is not None:
                        self._take(part, reply)
            missing = [p for p in parts if p.reply is None]
            if not missing:
                return
            now = time.monotonic()
            for part in missing:
                if part.reply is None and now >= self._attempt_end(part, start, deadline):
                    attempt = min(self._attempt_s(part.shard), self.timeout_s)
                    self._mark_down(
                        part.peer,
                        f"FFN peer {part.peer.address} did not reply to message {part.seq} "
                        f"within {attempt:.1f}s",
                    )
            late = [p for p in parts if p.reply is None]
            if late and now >= deadline:  # a failover attempt that ran out of time
                part = late[0]
                raise TransportError(
                    f"FFN peer {part.peer.address} did not reply to message {part.seq} "
                    f"within {self.timeout_s:.1f}s"
                )
            missing = [p for p in parts if p.reply is None]
            if not missing:
                continue
            part = min(missing, key=lambda p: self._attempt_end(p, start, deadline))
            peer = part.peer
            left = self._attempt_end(part, start, deadline) - time.monotonic()
            # Replies from this peer are taken as they come while we block on it; with
            # messages out on other peers, wake up often to take (and stamp) theirs too.
            others = any(
                p.up and p.outstanding > p.client.buffered for p in self.peers if p is not peer
            )
            reply = peer.client.poll(part.seq, max(0.0, min(left, _SWEEP_S) if others else left))
            if reply is not None:
                self._take(part, reply)

    def _attempt_s(self, shard: int) -> float:
        if self.failover_s > 0:
            return min(self.failover_s, self.timeout_s)
        return self.timeout_s / len(self.shards[shard])

    def _attempt_end(self, part: _Part, start: float, deadline: float) -> float:
        return min(deadline, max(part.started, start) + self._attempt_s(part.shard))

    def _take(self, part: _Part, reply: FFNReply) -> None:
        peer = part.peer
        peer.outstanding -= 1
        self._open.remove(part)
        if reply.ok:
            part.reply = reply
            return
        why = (
            f"FFN peer {peer.address} failed layer {reply.layer}: {reply.error_code}: {reply.error}"
        )
        if reply.error_code in _MESSAGE_ERRORS:
            raise TransportError(why)
        self._mark_down(peer, why)
        self._assign(part, why)

    def _assign(self, part: _Part, why: str) -> None:
        """Send the part to the first live replica of its shard. Every failure marks its
        replica down, so this never returns to one that just failed (until a probe has
        found it answering again)."""
        replicas = self.shards[part.shard]
        for peer in replicas:
            if not peer.up:
                continue
            seq = peer.next_seq
            peer.next_seq += 1
            now = time.time()
            attempt = self._attempt_s(part.shard)
            req = replace(part.message, seq=seq, deadline=now + attempt, t_send=now)
            if peer.client.send(req) is False:
                why = f"FFN peer {peer.address} did not reply to message {seq} (not connected)"
                self._mark_down(peer, why)
                continue
            part.peer, part.seq, part.reply = peer, seq, None
            part.sent, part.started = time.time(), time.monotonic()
            peer.outstanding += 1
            self._open.append(part)
            return
        if len(replicas) == 1:
            raise TransportError(
                why or f"FFN peer {replicas[0].address} is down: {replicas[0].reason}"
            )
        reasons = "; ".join(f"{p.address}: {p.reason}" for p in replicas)
        raise TransportError(
            f"{why + '; ' if why else ''}no live replica of FFN shard {part.shard} left ({reasons})"
        )

    def _mark_down(self, peer: Peer, why: str) -> None:
        """Stop using a replica until a probe says it is back; what it held goes elsewhere."""
        if not peer.up:
            return
        peer.up, peer.reason, peer.failures, peer.probe = False, why, 0, None
        peer.retry_at = time.monotonic() + _BACKOFF_S[0]
        peer.client.reset(below=peer.next_seq)  # its late replies must not be waited for
        peer.outstanding = 0
        log.warning("FFN peer %s marked down: %s", peer.address, why)
        for part in [p for p in self._open if p.peer is peer]:
            self._open.remove(part)
            self._assign(part, why)

    def maintain(self) -> None:
        """Probe the replicas marked down whose turn has come; never blocks. Runs on the
        engine thread between steps (begin_step, and the engine loop while idle)."""
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
        seq = peer.next_seq
        peer.next_seq += 1
        return FFNRequest(
            layer=0,
            micro_batch=0,
            seq=seq,
            hidden=torch.empty(0, self.cfg.hidden_size, dtype=torch.bfloat16),
            scales=None,
            expert_ids=torch.empty(0, k, dtype=torch.int32),
            expert_weights=torch.empty(0, k),
            sender=self.sender,
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
                    self._mark_down(peer, f"FFN peer {peer.address} is not connected")
                else:
                    sent.append((peer, req.seq))
        for peer, seq in sent:
            reply = peer.client.poll(seq, max(0.0, deadline - time.monotonic()))
            if reply is None:
                self._mark_down(
                    peer, f"FFN peer {peer.address} did not reply within {timeout:.1f}s"
                )
            elif not reply.ok:
                self._mark_down(peer, f"FFN peer {peer.address}: {reply.error}")
        for peer in self.peers:  # probes answered while the pings were out
            if not peer.up and peer.probe is not None:
                self._check_probe(peer, 0.0)
        down = [i for i, reps in enumerate(self.shards) if not any(p.up for p in reps)]
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

    def reset(self) -> None:
        """Abandon the messages in flight (after an error): their replies are dropped."""
        for peer in self.peers:
            if peer.up:
                peer.client.reset(below=peer.next_seq)
                peer.outstanding = 0
        self._open.clear()
        self._in_flight = 0
