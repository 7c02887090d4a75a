"""Load-based routing across M attention servers.

A background task polls every server's Stats (running + waiting requests, KV usage) a few
times a second; between polls the router also counts the streams it has itself sent to each
server, so a burst of requests spreads out instead of all landing on whichever server looked
idlest at the last poll. A server whose last poll failed is skipped until it answers again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from services.gateway.client import AttentionClient, Health
from services.gateway.errors import APIError, unavailable

log = logging.getLogger("afd.gateway")


@dataclass
class _Server:
    client: AttentionClient
    up: bool = True  # optimistic until a poll says otherwise
    seen: bool = False  # has answered at least once (quiet while the cluster starts)
    reported: int = 0  # running + waiting at the last poll
    kv_usage: float = 0.0
    inflight: int = 0  # streams this gateway has open to it now
    max_model_len: int = 0  # from Health; 0 until known

    @property
    def load(self) -> float:
        # The server's own count includes other gateways' requests; ours is fresher. KV usage
        # only breaks ties (it is < 1).
        return max(self.reported, self.inflight) + self.kv_usage


class Router:
    """Chooses the least-loaded attention server and tracks readiness and context length."""

    def __init__(self, clients: list[AttentionClient], poll_s: float = 0.25, ready_cache_s=0.5):
        if not clients:
            raise ValueError("at least one attention server is needed")
        self._servers = [_Server(c) for c in clients]
        self._poll_s = poll_s
        self._ready_cache_s = ready_cache_s
        self._ready: tuple[float, bool, list[str]] = (0.0, False, [])
        self._turn = itertools.count()
        self._task: asyncio.Task | None = None

    @property
    def clients(self) -> list[AttentionClient]:
        return [s.client for s in self._servers]

    async def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever(), name="router-poll")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(s.client.close() for s in self._servers), return_exceptions=True)

    def pick(self) -> AttentionClient:
        """The server with the least load; ties go round-robin."""
        up = [s for s in self._servers if s.up]
        if not up:
            raise unavailable("no attention server is reachable")
        start = next(self._turn) % len(up)
        rotated = up[start:] + up[:start]
        return min(rotated, key=lambda s: s.load).client

    @contextmanager
    def lease(self, client: AttentionClient) -> Iterator[None]:
        """Count one open stream against `client` for as long as the block runs."""
        server = next(s for s in self._servers if s.client is client)
        server.inflight += 1
        try:
            yield
        finally:
            server.inflight -= 1

    async def max_model_len(self) -> int:
        """The context length every server can serve (the smallest), asking now if unknown."""
        known = [s.max_model_len for s in self._servers if s.max_model_len]
        if not known:
            await self._refresh_health()
            known = [s.max_model_len for s in self._servers if s.max_model_len]
        if not known:
            raise unavailable("no attention server has reported its context length yet")
        return min(known)

    async def readiness(self) -> tuple[bool, list[str]]:
        """(ready, reasons): ready only when every attention server says it is."""
        t, ready, reasons = self._ready
        if time.monotonic() - t < self._ready_cache_s:
            return ready, reasons
        healths = await self._refresh_health()
        reasons = []
        for s, h in zip(self._servers, healths, strict=True):
            if isinstance(h, APIError):
                reasons.append(f"{s.client.address}: {h.message}")
            elif not h.ready:
                reasons.append(f"{s.client.address}: {h.reason or 'not ready'}")
        ready = not reasons
        self._ready = (time.monotonic(), ready, reasons)
        return ready, reasons

    async def _refresh_health(self) -> list[Health | APIError]:
        results = await asyncio.gather(
            *(s.client.health() for s in self._servers), return_exceptions=True
        )
        out: list[Health | APIError] = []
        for s, r in zip(self._servers, results, strict=True):
            if isinstance(r, Health):
                s.max_model_len = r.max_model_len
                s.up = True
                out.append(r)
            else:
                out.append(r if isinstance(r, APIError) else unavailable(str(r)))
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
                continue
            if not (s.seen and s.up):
                log.info("attention server %s is up", s.client.address)
            s.up = s.seen = True
            s.reported = r.running + r.waiting
            s.kv_usage = r.kv_usage
        if any(s.up and not s.max_model_len for s in self._servers):
            await self._refresh_health()

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # never let the poller die: routing would freeze
                log.exception("router poll failed")
            await asyncio.sleep(self._poll_s)
