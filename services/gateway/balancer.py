"""Routing across M attention servers: prefix-aware with a load guard (`routing.py`), or
least-loaded, or round-robin.

A background task polls every server's Stats (running + waiting requests, KV usage, draining)
a few times a second, and its Health (ready: its FFN pool covers every expert) about once a
second; between polls the balancer also counts the streams it has itself sent to each server, so
a burst of requests spreads out instead of all landing on whichever server looked idlest at the
last poll. A server whose last poll failed, or whose stream broke (`failed`), is marked down and
skipped until a poll finds it answering again; a draining one is skipped; ready ones are
preferred. The gateway is ready when at least one server is ready. Each poll also reads the
servers' prefix-cache counters, so the gateway's metrics show every server's hit rate.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from afd import metrics
from services.gateway.client import AttentionClient, Health
from services.gateway.errors import APIError, PeerUnavailable, starting, unavailable
from services.gateway.routing import Ring, RoutingConfig, routing_key

log = logging.getLogger("afd.gateway")


@dataclass
class _Server:
    client: AttentionClient
    up: bool = True  # optimistic until a poll says otherwise
    ready: bool = True  # its Health: the FFN pool covers every expert (optimistic too)
    draining: bool = False  # shutting down: finishing what it has, taking nothing new
    reason: str = ""  # why it is down or not ready
    seen: bool = False  # has answered at least once (quiet while the cluster starts)
    reported: int = 0  # running + waiting at the last poll
    kv_usage: float = 0.0
    inflight: int = 0  # streams this gateway has open to it now
    max_model_len: int = 0  # from Health; 0 until known
    prefix_queries: int = 0  # its prefix cache's counters at the last poll (prompt tokens)
    prefix_hits: int = 0

    @property
    def load(self) -> float:
        # The server's own count includes other gateways' requests; ours is fresher. KV usage
        # only breaks ties (it is < 1).
        return max(self.reported, self.inflight) + self.kv_usage

    @property
    def state(self) -> str:
        if not self.up:
            return "down"
        if self.draining:
            return "draining"
        return "ready" if self.ready else "not ready"


class Balancer:
    """Chooses an attention server for each request and tracks readiness and context length."""

    def __init__(
        self,
        clients: list[AttentionClient],
        poll_s: float = 0.25,
        ready_cache_s=0.5,
        health_s: float = 1.0,
        routing: RoutingConfig | None = None,
    ):
        if not clients:
            raise ValueError("at least one attention server is needed")
        self._servers = [_Server(c) for c in clients]
        self.routing = routing or RoutingConfig()
        self._ring = Ring([c.address for c in clients])
        self._routed = {
            (s.client.address, why): metrics.ROUTED.labels(s.client.address, why)
            for s in self._servers
            for why in metrics.ROUTE_REASONS
        }
        self._hit_rate = {
            s.client.address: metrics.SERVER_PREFIX_HIT_RATE.labels(s.client.address)
            for s in self._servers
        }
        self._poll_s = poll_s
        self._health_s = health_s
        self._last_health = 0.0
        self._ready_cache_s = ready_cache_s
        self._ready: tuple[float, bool, list[str]] = (0.0, False, [])
        self._turn = itertools.count()
        self._task: asyncio.Task | None = None
        self.started = False  # some server has been ready, with its context length, once

    @property
    def clients(self) -> list[AttentionClient]:
        return [s.client for s in self._servers]

    async def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever(), name="balancer-poll")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(s.client.close() for s in self._servers), return_exceptions=True)

    def pick(
        self, exclude: tuple[AttentionClient, ...] = (), prompt: Sequence[int] | None = None
    ) -> AttentionClient:
        """A server among the reachable ones that are not draining (ready ones first) for a
        request with this prompt, by the routing policy; without a prompt, the least loaded.
        Ties go round-robin."""
        up = [s for s in self._servers if s.up and not s.draining and s.client not in exclude]
        if not up:
            raise unavailable("no attention server is reachable")
        up = [s for s in up if s.ready] or up  # not ready: its requests would fail
        start = next(self._turn) % len(up)
        rotated = up[start:] + up[:start]
        policy = self.routing.policy if prompt is not None else "least-loaded"
        if policy == "round-robin":
            return self._route(rotated[0], "round_robin")
        idlest = min(rotated, key=lambda s: s.load)
        if policy == "least-loaded" or len(up) == 1:
            return self._route(idlest, "least_loaded")
        assert prompt is not None
        owner = self._owner(routing_key(prompt, self.routing.prefix_tokens), up)
        r = self.routing
        if owner.load - idlest.load > r.balance_abs and owner.load > r.balance_ratio * idlest.load:
            return self._route(idlest, "balance")
        return self._route(owner, "prefix")

    def _owner(self, key: bytes, candidates: list[_Server]) -> _Server:
        """The first of `candidates` along the ring from the key's point."""
        for i in self._ring.order(key):
            if self._servers[i] in candidates:
                return self._servers[i]
        raise AssertionError("every server is on the ring")

    def _route(self, server: _Server, why: str) -> AttentionClient:
        self._routed[(server.client.address, why)].inc()
        return server.client

    async def failed(self, client: AttentionClient, error: APIError) -> bool:
        """A call to `client` failed with `error`: mark the server down if it is unreachable,
        and say whether another server may serve the request instead (the server is gone or
        draining, rather than failing the request on its own account)."""
        server = self._server(client)
        if isinstance(error, PeerUnavailable):
            if server.up:
                log.warning("attention server %s is down: %s", client.address, error.message)
            server.up, server.reason = False, error.message
            self._ready = (0.0, False, [])
            return True
        if error.status != 503:
            return False
        try:  # unavailable: is it the server that is going (draining), or its FFN pool?
            stats = await client.stats()
        except APIError as e:
            server.up, server.reason = False, e.message
            return True
        server.draining = stats.draining
        return stats.draining

    @contextmanager
    def lease(self, client: AttentionClient) -> Iterator[None]:
        """Count one open stream against `client` for as long as the block runs."""
        server = self._server(client)
        server.inflight += 1
        try:
            yield
        finally:
            server.inflight -= 1

    async def wait_started(self, timeout: float) -> None:
        """Return once some attention server has been ready (and said its context length);
        while the cluster is starting, wait for that up to `timeout`, then raise a 503
        'starting' error. Once started this returns at once, whatever happens later."""
        deadline = time.monotonic() + timeout
        while not self.started:
            await self._refresh_health()
            if self.started:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise starting(
                    "the cluster is starting: no attention server is ready yet; retry shortly"
                )
            await asyncio.sleep(min(0.25, left))

    async def max_model_len(self) -> int:
        """The context length every server can serve (the smallest), asking now if unknown."""
        known = [s.max_model_len for s in self._servers if s.max_model_len]
        if not known:
            await self._refresh_health()
            known = [s.max_model_len for s in self._servers if s.max_model_len]
        if not known:
            raise unavailable("no attention server has reported its context length yet")
        return min(known)

    def _server(self, client: AttentionClient) -> _Server:
        return next(s for s in self._servers if s.client is client)

    async def readiness(self) -> tuple[bool, list[str]]:
        """(ready, reasons): ready when at least one attention server is ready (and not
        draining); the reasons name every server that is not."""
        t, ready, reasons = self._ready
        if time.monotonic() - t < self._ready_cache_s:
            return ready, reasons
        await self._refresh_health()
        reasons = [
            f"{s.client.address}: {s.reason or s.state}"
            for s in self._servers
            if s.state != "ready"
        ]
        ready = any(s.state == "ready" for s in self._servers)
        self._ready = (time.monotonic(), ready, reasons)
        return ready, reasons

    def servers(self) -> list[dict]:
        """Every attention server's state as last seen (ready | not ready | draining | down)."""
        return [
            {
                "address": s.client.address,
                "state": s.state,
                "reason": s.reason,
                "running": s.reported,
                "inflight": s.inflight,
                "kv_usage": round(s.kv_usage, 4),
                "prefix_cache_hit_rate": round(_rate(s), 4),
            }
            for s in self._servers
        ]

    async def _refresh_health(self) -> list[Health | APIError]:
        results = await asyncio.gather(
            *(s.client.health() for s in self._servers), return_exceptions=True
        )
        self._last_health = time.monotonic()
        out: list[Health | APIError] = []
        for s, r in zip(self._servers, results, strict=True):
            if isinstance(r, Health):
                s.max_model_len = r.max_model_len
                if not s.up:
                    log.info("attention server %s is back", s.client.address)
                s.up, s.ready, s.draining = True, r.ready, r.draining
                s.reason = "" if r.ready else (r.reason or "not ready")
                self.started |= r.ready and not r.draining and r.max_model_len > 0
                out.append(r)
            else:
                err = r if isinstance(r, APIError) else _unexpected(s, r)
                s.up, s.reason = False, err.message
                out.append(err)
        return out

    async def poll_once(self) -> None:
        results = await asyncio.gather(
            *(s.client.stats() for s in self._servers), return_exceptions=True
        )
        for s, r in zip(self._servers, results, strict=True):
            if isinstance(r, BaseException):
                if s.seen and s.up:
                    log.warning("attention server %s stopped answering: %s", s.client.address, r)
                s.up = False
                s.reason = (r if isinstance(r, APIError) else _unexpected(s, r)).message
                continue
            if not (s.seen and s.up):
                log.info("attention server %s is up", s.client.address)
                s.reason = "" if s.ready else s.reason
            s.up = s.seen = True
            s.reported = r.running + r.waiting
            s.kv_usage = r.kv_usage
            s.draining = r.draining
            s.prefix_queries, s.prefix_hits = r.prefix_queries, r.prefix_hits
            self._hit_rate[s.client.address].set(_rate(s))
        due = time.monotonic() - self._last_health >= self._health_s
        if due or any(s.up and not s.max_model_len for s in self._servers):
            await self._refresh_health()

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # never let the poller die: routing would freeze
                log.exception("balancer poll failed")
            await asyncio.sleep(self._poll_s)


def _rate(s: _Server) -> float:
    return s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0


def _unexpected(s: _Server, e: BaseException) -> APIError:
    """An error the client did not turn into an APIError: logged here, and named by the
    server it came from (not by its text, which /ready would otherwise echo)."""
    log.warning(
        "attention server %s: unexpected %s", s.client.address, type(e).__name__, exc_info=e
    )
    return unavailable(f"attention server {s.client.address} is unavailable (unexpected error)")
