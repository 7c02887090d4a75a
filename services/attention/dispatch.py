"""Dispatch of one layer's FFN work to the FFN pool and reduction of the partial outputs.

Every FFN server holds one expert shard (replicas.py: which servers, which are up). A MoE
layer's tokens go to every shard that holds one of their experts (shard 0 always, for the
shared expert); a dense layer goes to shard 0 alone. The partial outputs are summed in
float32 and returned in the compute dtype.

Failover: a replica that does not reply within its attempt time (the FFN timeout split
between the shard's replicas, or `failover_s`; shorter once its usual round trip is known:
deadlines.py), answers with an error of its own, or cannot take a message is marked down, and
every message it held is sent again to another live replica of the shard, within the same
deadline, so no request is lost while one replica is left. An error that says the message
itself was bad is raised at once (another replica would refuse it too).

Where every shard is one in-process listener that computes on the sender's thread (S = 1 with
inproc:// shards), a layer is a function call: `FFNServing.serve_local` at send, no message,
no queue; a failed compute fails the step (there is no other replica).

The dispatcher also records the step in progress (step_record.py): its timing (every reply
with its round-trip stamps, the engine thread's own work between calls, the most micro-batches
with FFN work outstanding at once) and its routing. While a reply is awaited and other
messages are out, every peer is polled about once a millisecond, so each reply's arrival stamp
(trace.a_recv) is within that of its arrival rather than of the moment the engine took it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from afd.config import ModelConfig
from afd.device import CPU, to_host
from afd.errors import ConfigError, TransportError
from afd.messages import FFNReply, FFNRequest
from afd.quant import quantize_fp8
from afd.transport.serving import FFNServing
from services.attention.deadlines import RoundTripDeadlines
from services.attention.placement import NOT_HERE, Placement
from services.attention.replicas import Peer, Replicas
from services.attention.step_record import RoutedLoad, StepTiming

_WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SWEEP_S = 0.001  # while several replies are out: how often every peer is polled
_WAKE_S = 0.5  # the longest wait before every peer's connection is looked at again
# Errors that say our message was bad: another replica would refuse it too, so no failover.
_MESSAGE_ERRORS = ("bad_request", "bad_header", "bad_version", "bad_size", "bad_value")


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


class FFNDispatcher:
    def __init__(
        self,
        cfg: ModelConfig,
        replicas: Replicas,
        a2f_dtype: str,
        compute_dtype: torch.dtype,
        sender: str = "attention",
        device: torch.device = CPU,
    ):
        if a2f_dtype not in ("fp8", *_WIRE):
            raise ConfigError(f"a2f dtype must be fp8, bf16 or fp32, got {a2f_dtype!r}")
        self.cfg = cfg
        self.replicas = replicas
        replicas.on_down = self._resend_from
        self.a2f_dtype = a2f_dtype
        self.dtype = compute_dtype
        self.device = device  # the attention side's: replies are added to hidden states there
        self.sender = sender
        self.timing = StepTiming()
        self.deadlines = RoundTripDeadlines()  # each replica's usual answer time, learnt
        self._open: list[_Part] = []  # parts sent whose reply has not been taken
        self._in_flight = 0
        self._idle_since = 0.0  # perf_counter() when the pool last returned; 0: step start
        # tokens routed to each expert in completed steps: exported (expert_load), and what
        # an elastic pool's placement balances
        self.routed = RoutedLoad(cfg.num_layers, cfg.num_experts)
        # an elastic pool's placement (set between steps); None: fixed expert shards
        self.placement: Placement | None = None
        # each shard's serving loop, where every shard is one live replica computing inline in
        # this process (afd serve's one-process topology): called, not sent to. Looked up at a
        # step's first send (after the engine has refreshed an elastic pool).
        self._direct: list[FFNServing] | None = None
        self._direct_known = False

    def begin_step(self) -> None:
        """A new step's timing; probe replicas that are due."""
        self.replicas.maintain()
        self.routed.drop_step()
        self.timing = StepTiming()
        self._in_flight = 0
        self._idle_since = 0.0
        self._direct_known = False

    @property
    def _direct_here(self) -> bool:
        """Every shard is called in process and computes on this side's device."""
        return self._direct is not None and all(s.device == self.device for s in self._direct)

    def inline_shard(self) -> tuple[FFNServing, str] | None:
        """(serving, address) of the one in-process shard that is the whole pool and computes
        on this thread and device, where it offers its experts to be called directly
        (FFNServing.inline_experts) and the wire is bf16 (what the experts read as sent); else
        None. A caller that runs layers with them reports them with `ran_inline`."""
        if self.a2f_dtype != "bf16" or self.dtype != torch.bfloat16:
            return None
        if not self._direct_known:
            self._direct, self._direct_known = self._direct_servings(), True
        if self._direct is None or len(self._direct) != 1 or not self._direct_here:
            return None
        serving = self._direct[0]
        if serving.draining or serving.inline_experts is None:
            return None
        return serving, self.replicas.shards[0][0].address

    def ran_inline(
        self,
        first: int,
        ids: torch.Tensor,  # [n, T, k] int32: layers first .. first + n - 1's routing
        stamps: torch.Tensor,  # [m, 3] float64 (StepTiming.inline): a layer's run each
        tokens: int | None = None,  # the tokens of each run (default: T)
    ) -> None:
        """Layers the caller ran with the inline shard's kernels: their routing is counted and
        their timing kept, as the messages' would have been (a burst: m runs of T tokens, the
        routing of its steps together per layer)."""
        if not len(ids):
            return
        shard = self.inline_shard()
        assert shard is not None
        serving, address = shard
        self.routed.add(first, ids)
        self.timing.inline.append((address, stamps))
        self.timing.max_in_flight = max(self.timing.max_in_flight, 1)
        serving.served_inline(tokens or ids.shape[1], [e - a for _, a, e in stamps.tolist()])
        self._idle_since = time.perf_counter()

    def _direct_servings(self) -> list[FFNServing] | None:
        if self.placement is not None:
            return None
        servings = []
        for replicas in self.replicas.shards:
            serving = replicas[0].client.local() if len(replicas) == 1 else None
            if serving is None or not replicas[0].up:
                return None
            servings.append(serving)
        return servings

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
            wire = _WIRE[self.a2f_dtype]
            hidden, scales = (x if x.dtype == wire else x.to(wire)), None
        if not self._direct_known:
            self._direct, self._direct_known = self._direct_servings(), True
        if self.device.type != "cpu" and not self._direct_here:
            # messages hold host tensors (afd/device.py): encoded on the device (FP8 first:
            # fewer bytes to copy), then one copy each to the host. In-process shards that
            # compute on this same device take the device's tensors as they are.
            hidden, ids, weights = to_host(hidden), to_host(ids), to_host(weights)
            scales = None if scales is None else to_host(scales)
        if self._idle_since:
            self.timing.attention_seconds.append(time.perf_counter() - self._idle_since)
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
        moe = self.cfg.is_moe(layer)
        if moe:
            self.routed.add(layer, ids)
        if self._direct is not None:
            parts = self._call_direct(message, moe)
        elif self.placement is not None:
            parts = self._elastic_parts(layer, message)
        else:
            parts = [
                _Part(shard, message)
                for shard, replicas in enumerate(self.replicas.shards)
                if moe or replicas[0].shard.owns_dense
            ]
        for part in parts:
            if part.reply is None:
                self._assign(part, "")
        self._in_flight += 1
        self.timing.max_in_flight = max(self.timing.max_in_flight, self._in_flight)
        self._idle_since = time.perf_counter()
        return Pending(parts, x.shape[0])

    def _call_direct(self, message: FFNRequest, moe: bool) -> list[_Part]:
        """The layer computed now by each in-process shard that takes part; its parts come
        back answered. There is no other replica to fail over to: an error fails the step."""
        assert self._direct is not None
        parts = []
        for shard, serving in enumerate(self._direct):
            peer = self.replicas.shards[shard][0]
            if not (moe or peer.shard.owns_dense):
                continue
            sent = time.time()
            reply = serving.serve_local(message, sent)
            if not reply.ok:
                raise TransportError(
                    f"FFN shard {peer.address} failed layer {message.layer}: "
                    f"{reply.error_code}: {reply.error}"
                )
            parts.append(_Part(shard, message, peer=peer, sent=sent, reply=reply))
        return parts

    @property
    def expert_load(self) -> torch.Tensor:  # [L, E] int64
        return self.routed.load

    def count_routed(self, flush: bool = False) -> None:
        """A step completed: its routing is counted (in batches of steps, or now with `flush`
        when the engine runs out of work)."""
        if flush:
            for serving in self._direct or ():
                serving.flush_local()  # the in-process shards' FFN metrics, likewise batched
        self.routed.step_done(flush)

    def _elastic_parts(self, layer: int, message: FFNRequest) -> list[_Part]:
        """One part per live member with work in this layer: the pairs the placement gives it
        (the other ids sent as NOT_HERE) and, for one member, the shared expert and dense
        MLPs."""
        pl = self.placement
        assert pl is not None
        owner = pl.dense_owner
        if not self.cfg.is_moe(layer):
            return [_Part(owner, message)]
        ids = message.expert_ids  # [T, k]
        member = pl.assign(layer, ids)  # [T, k]
        parts = []
        shared = self.cfg.shared_expert_intermediate_size > 0
        for m in range(pl.members):
            mine = member == m
            if not (shared and m == owner) and not bool(mine.any()):
                continue
            masked = torch.where(mine, ids, NOT_HERE).to(torch.int32)
            parts.append(_Part(m, replace(message, expert_ids=masked, skip_dense=m != owner)))
        return parts

    def collect(self, pending: Pending) -> torch.Tensor:  # [T, H] compute dtype
        self._gather(pending)
        total: torch.Tensor | None = None
        out: torch.Tensor | None = None
        for part in pending.parts:
            reply = part.reply
            assert reply is not None and part.peer is not None
            tr = reply.trace
            if tr.a_sent != part.sent or not tr.a_recv:  # else stamped already (_call_direct)
                stamped = replace(tr, a_sent=part.sent, a_recv=tr.a_recv or time.time())
                reply = replace(reply, trace=stamped)
            self.timing.traces.append((part.peer.address, reply))
            out = reply.output
            if len(pending.parts) > 1:
                total = out.float() if total is None else total.add_(out.float())
        self._in_flight -= 1
        self._idle_since = time.perf_counter()
        if total is None:
            assert out is not None
            if out.dtype == self.dtype and out.device == self.device:
                return out
            return out.to(self.device, self.dtype)
        return total.to(self.device, self.dtype)

    def reset(self) -> None:
        """Abandon the messages in flight (after an error): their replies are dropped."""
        self.replicas.reset()
        self._open.clear()
        self._in_flight = 0

    def _gather(self, pending: Pending) -> None:
        """Every part's reply (part.reply), failing over to another replica of its shard when
        one does not answer within its attempt time; raises TransportError when a shard has
        no live replica left or the deadline passes."""
        parts, peers = pending.parts, self.replicas.peers
        start = time.monotonic()
        deadline = start + self.replicas.timeout_s
        while True:
            if len(peers) > 1:
                for peer in peers:
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
                lost = part.reply is None and part.peer.client.lost_since(part.started)
                if lost:  # its reply will never come: no need to wait out the attempt time
                    self.replicas.mark_down(
                        part.peer, f"FFN peer {part.peer.address} is gone ({lost})"
                    )
                elif part.reply is None and now >= self._attempt_end(part, start, deadline):
                    attempt = min(self._attempt_s(part), self.replicas.timeout_s)
                    self.replicas.mark_down(
                        part.peer,
                        f"FFN peer {part.peer.address} did not reply to message {part.seq} "
                        f"within {attempt:.1f}s",
                    )
            late = [p for p in parts if p.reply is None]
            if late and now >= deadline:  # a failover attempt that ran out of time
                part = late[0]
                raise TransportError(
                    f"FFN peer {part.peer.address} did not reply to message {part.seq} "
                    f"within {self.replicas.timeout_s:.1f}s"
                )
            missing = [p for p in parts if p.reply is None]
            if not missing:
                continue
            part = min(missing, key=lambda p: self._attempt_end(p, start, deadline))
            peer = part.peer
            left = self._attempt_end(part, start, deadline) - time.monotonic()
            # Replies from this peer are taken as they come while we block on it; with
            # messages out on other peers, wake up often to take (and stamp) theirs too.
            others = any(p.up and p.outstanding > p.client.buffered for p in peers if p is not peer)
            wait = min(left, _SWEEP_S if others else _WAKE_S)
            reply = peer.client.poll(part.seq, max(0.0, wait))
            if reply is not None:
                self._take(part, reply)

    def _attempt_end(self, part: _Part, start: float, deadline: float) -> float:
        return min(deadline, max(part.started, start) + self._attempt_s(part))

    def _attempt_s(self, part: _Part) -> float:
        """The part's attempt time: what its replica usually needs for a message of its size
        (deadlines.py), within the replica's share of the FFN timeout."""
        bound = self.replicas.attempt_s(part.shard)
        return self.deadlines.limit(part.peer.address, part.message.num_tokens, bound)

    def _take(self, part: _Part, reply: FFNReply) -> None:
        peer = part.peer
        peer.outstanding -= 1
        self._open.remove(part)
        if reply.ok:
            part.reply = reply
            seconds = time.monotonic() - part.started
            self.deadlines.observe(peer.address, seconds, part.message.num_tokens)
            return
        why = (
            f"FFN peer {peer.address} failed layer {reply.layer}: {reply.error_code}: {reply.error}"
        )
        if reply.error_code in _MESSAGE_ERRORS:
            raise TransportError(why)
        self.replicas.mark_down(peer, why)
        self._assign(part, why)

    def _assign(self, part: _Part, why: str) -> None:
        """Send the part to the first live replica of its shard. Every failure marks its
        replica down, so this never returns to one that just failed (until a probe has
        found it answering again)."""
        peer, seq = self.replicas.send(part.shard, part.message, why)
        part.peer, part.seq, part.reply = peer, seq, None
        part.sent, part.started = time.time(), time.monotonic()
        self._open.append(part)

    def _resend_from(self, peer: Peer, why: str) -> None:
        """A replica was marked down: what it held goes to another replica of its shard."""
        for part in [p for p in self._open if p.peer is peer]:
            self._open.remove(part)
            self._assign(part, why)
