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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from afd.config import ModelConfig
from afd.errors import TransportError
from afd.quant import quantize_fp8
from afd.sharding import ExpertShard
from afd.transport.base import FFNClient
from afd.transport.messages import FFNReply, FFNRequest

_WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SWEEP_S = 0.001  # while several replies are out: how often every peer is polled


@dataclass
class Peer:
    client: FFNClient
    shard: ExpertShard
    next_seq: int = 0
    outstanding: int = 0  # messages sent whose reply has not been collected


@dataclass(frozen=True)
class Pending:
    """What is in flight for one (layer, micro-batch): (peer, seq, rows it covers or None)."""

    parts: tuple[tuple[Peer, int, torch.Tensor | None], ...]
    num_tokens: int
    sent: tuple[float, ...] = ()  # per part: time.time() when its send call returned


class FFNPool:
    def __init__(
        self,
        cfg: ModelConfig,
        peers: list[Peer],
        a2f_dtype: str,
        compute_dtype: torch.dtype,
        timeout_s: float,
        sender: str = "attention",
    ):
        if a2f_dtype not in ("fp8", *_WIRE):
            raise ValueError(f"a2f dtype must be fp8, bf16 or fp32, got {a2f_dtype!r}")
        self.cfg = cfg
        self.peers = peers
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
        """Forget the previous step's timing."""
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
        parts, sent = [], []
        for peer in self.peers:
            if not self.cfg.is_moe(layer) and not peer.shard.owns_dense:
                continue
            seq = peer.next_seq
            peer.next_seq += 1
            req = FFNRequest(
                layer=layer,
                micro_batch=micro_batch,
                seq=seq,
                hidden=hidden,
                scales=scales,
                expert_ids=ids,
                expert_weights=weights,
                sender=self.sender,
                deadline=time.time() + self.timeout_s,
                t_send=time.time(),
            )
            peer.client.send(req)
            sent.append(time.time())
            peer.outstanding += 1
            parts.append((peer, seq, None))
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        self._idle_since = time.perf_counter()
        return Pending(tuple(parts), x.shape[0], tuple(sent))

    def collect(self, pending: Pending) -> torch.Tensor:  # [T, H] compute dtype
        replies = self._gather(pending)
        total: torch.Tensor | None = None
        out: torch.Tensor | None = None
        for (peer, _seq, _rows), reply, sent in zip(
            pending.parts, replies, pending.sent, strict=True
        ):
            if not reply.ok:
                raise TransportError(
                    f"FFN peer {peer.client.address} failed layer {reply.layer}: "
                    f"{reply.error_code}: {reply.error}"
                )
            tr = reply.trace
            stamped = replace(tr, a_sent=sent, a_recv=tr.a_recv or time.time())
            self.traces.append((peer.client.address, replace(reply, trace=stamped)))
            out = reply.output
            if len(pending.parts) > 1:
                total = out.float() if total is None else total.add_(out.float())
        self._in_flight -= 1
        self._idle_since = time.perf_counter()
        if total is None:
            assert out is not None
            return out.to(self.dtype)
        return total.to(self.dtype)

    def _gather(self, pending: Pending) -> list[FFNReply]:
        """Every part's reply, in part order; raises TransportError naming a peer that did
        not answer within the timeout."""
        parts = pending.parts
        got: list[FFNReply | None] = [None] * len(parts)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if len(self.peers) > 1:
                for peer in self.peers:
                    if peer.outstanding > peer.client.buffered:
                        peer.client.drain()
            missing = None
            for i, (peer, seq, _rows) in enumerate(parts):
                if got[i] is None:
                    got[i] = peer.client.poll(seq)
                    if got[i] is not None:
                        peer.outstanding -= 1
                    elif missing is None:
                        missing = i
            if missing is None:
                return got  # type: ignore[return-value]
            peer, seq, _rows = parts[missing]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(
                    f"FFN peer {peer.client.address} did not reply to message {seq} "
                    f"within {self.timeout_s:.1f}s"
                )
            # Replies from this peer are taken as they come while we block on it; with
            # messages out on other peers, wake up often to take (and stamp) theirs too.
            others = any(p.outstanding > p.client.buffered for p in self.peers if p is not peer)
            reply = peer.client.poll(seq, min(left, _SWEEP_S) if others else left)
            if reply is not None:
                got[missing] = reply
                peer.outstanding -= 1

    def ping(self, timeout: float) -> None:
        """An empty message to every peer; raises TransportError naming the first that fails."""
        k = self.cfg.top_k if self.cfg.is_moe(0) else 0
        H = self.cfg.hidden_size
        for peer in self.peers:
            seq = peer.next_seq
            peer.next_seq += 1
            peer.client.send(
                FFNRequest(
                    layer=0,
                    micro_batch=0,
                    seq=seq,
                    hidden=torch.empty(0, H, dtype=torch.bfloat16),
                    scales=None,
                    expert_ids=torch.empty(0, k, dtype=torch.int32),
                    expert_weights=torch.empty(0, k),
                    sender=self.sender,
                    deadline=time.time() + timeout,
                    t_send=time.time(),
                )
            )
            reply = peer.client.wait(seq, timeout)
            if not reply.ok:
                raise TransportError(f"FFN peer {peer.client.address}: {reply.error}")

    def wait_ready(self, timeout: float, probe_s: float = 2.0) -> None:
        """Ping until every peer answers (a send to a peer that is still starting is dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.ping(probe_s)
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                self.reset()

    def reset(self) -> None:
        for peer in self.peers:
            peer.client.reset()
            peer.outstanding = 0
        self._in_flight = 0
