"""An elastic FFN pool: members join and leave while the engine runs.

The pool is read from its source (`pool_source.py`) between steps. A new member is connected
and probed; it takes work once it has answered (its placement share is computed then). A
member that left the source is dropped at once: no message of a later step goes to it, and
none of an earlier one is still out (a step collects every reply before it ends). Whenever the
set of live members changes, and every `rebalance_s` while expert loads are being counted, the
placement (`placement.py`) is computed again, at a step boundary, so every message of a step
is sent, and answered, under one placement.

Every member can compute every expert, so a member that fails mid-step has its messages sent
again to the next live member, as a replica would be (`replicas.py`): the pool as the
dispatcher sees it is one "shard" per live member, whose replicas are all live members in ring
order starting from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from afd.config import ModelConfig
from afd.sharding import ExpertShard
from afd.transport.base import FFNClient
from services.attention.placement import Placement
from services.attention.pool_source import PoolSource
from services.attention.replicas import Peer, Replicas

log = logging.getLogger("afd.attention")


class ElasticPool:
    def __init__(
        self,
        cfg: ModelConfig,
        source: PoolSource,
        replicas: Replicas,
        connect: Callable[[str], FFNClient],
        load: torch.Tensor,  # [L, E] tokens routed to each expert so far (the dispatcher's)
        hot: int = 0,
        rebalance_s: float = 30.0,
    ):
        self.cfg = cfg
        self.source = source
        self.replicas = replicas
        self._connect = connect
        self.hot = hot
        self.rebalance_s = rebalance_s
        self.placement: Placement | None = None
        self._live: tuple[str, ...] = ()  # members in the placement, in its order
        self._placed_at = 0.0
        self.load = load
        self.changes = 0  # placements computed (for logs and tests)
        self.refresh(force=True)

    @property
    def members(self) -> list[str]:
        return [p.address for p in self.replicas.peers]

    def refresh(self, force: bool = False) -> None:
        """Between steps: take in the source's changes, then place again if the live set
        changed or the loads are due a rebalance."""
        found = self.source.members(force=force)
        if found is not None and found != tuple(self.members):
            self._apply(found)
        live = tuple(p.address for p in self.replicas.peers if p.up)
        due = self.hot and time.monotonic() - self._placed_at >= self.rebalance_s
        if live != self._live or self.placement is None or due:
            self._place(live)

    def _apply(self, found: tuple[str, ...]) -> None:
        old = {p.address: p for p in self.replicas.peers}
        peers = []
        for addr in found:
            peer = old.pop(addr, None)
            if peer is None:
                shard = ExpertShard(0, 1, self.cfg.num_experts)  # it holds every expert
                peer = Peer(self._connect(addr), shard)
                # taken in by a probe, at once, once it answers
                peer.up, peer.reason, peer.retry_at = False, "joining", 0.0
                log.info("FFN pool: %s joins", addr)
            peers.append(peer)
        for addr, peer in old.items():
            log.info("FFN pool: %s leaves", addr)
            peer.client.close()
        self.replicas.peers = peers

    def _place(self, live: tuple[str, ...]) -> None:
        by_addr = {p.address: p for p in self.replicas.peers}
        ring = [by_addr[a] for a in live]
        # one "shard" per live member; its replicas: every live member, from it round the ring
        shards = [ring[i:] + ring[:i] for i in range(len(ring))]
        down = [p for p in self.replicas.peers if not p.up]
        self.replicas.shards = shards or [down]  # none live: one shard, uncovered
        counted = self.load if bool(self.load.any()) else None
        self.placement = (
            Placement.compute(
                len(ring), self.cfg.num_layers, self.cfg.num_experts, counted, self.hot
            )
            if ring
            else None
        )
        if live != self._live:
            log.info("FFN pool: placement over %d live member(s): %s", len(ring), ", ".join(live))
        self._live = live
        self._placed_at = time.monotonic()
        self.changes += 1
