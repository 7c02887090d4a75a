"""Dispatch of one layer's FFN work to the FFN pool and reduction of the partial outputs.

Every peer holds one expert shard. A MoE layer's tokens go to every shard that holds one of
their experts (shard 0 always, for the shared expert); a dense layer goes to shard 0 alone.
The partial outputs are summed in float32 and returned in the compute dtype.
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


@dataclass
class Peer:
    client: FFNClient
    shard: ExpertShard
    next_seq: int = 0


@dataclass(frozen=True)
class Pending:
    """What is in flight for one (layer, micro-batch): (peer, seq, rows it covers or None)."""

    parts: tuple[tuple[Peer, int, torch.Tensor | None], ...]
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
        parts = []
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
            parts.append((peer, seq, None))
        return Pending(tuple(parts), x.shape[0])

    def collect(self, pending: Pending) -> torch.Tensor:  # [T, H] compute dtype
        total: torch.Tensor | None = None
        for peer, seq, _rows in pending.parts:
            reply = peer.client.wait(seq, self.timeout_s)
            if not reply.ok:
                raise TransportError(
                    f"FFN peer {peer.client.address} failed layer {reply.layer}: "
                    f"{reply.error_code}: {reply.error}"
                )
            if not reply.trace.a_recv:  # the in-process backend has no receive stamp of its own
                reply = replace(reply, trace=replace(reply.trace, a_recv=time.time()))
            self.traces.append((peer.client.address, reply))
            out = reply.output
            if len(pending.parts) == 1:
                return out.to(self.dtype)
            total = out.float() if total is None else total.add_(out.float())
        assert total is not None
        return total.to(self.dtype)

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
