"""Draining on SIGTERM: new requests get 503 while those in flight finish, then the process
exits 0.

`Lifecycle` counts the requests in flight and knows whether the gateway is draining;
`DrainMiddleware` refuses new work while it is (the probes and /metrics still answer, and
/ready says "draining", so a load balancer stops sending here); `DrainingServer` is uvicorn's
server with SIGTERM / SIGINT turned into a drain of up to `drain_timeout_s`, after which
uvicorn's own shutdown runs (a second signal skips the wait).
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from services.gateway.errors import error_body
from services.gateway.middleware import send_json

log = logging.getLogger("afd.gateway")

# Answered while draining: liveness, readiness (which then says so) and the metrics.
_ALWAYS = ("/health", "/ready", "/metrics")


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0  # HTTP requests being served (a stream counts until its last byte)

    async def drain(self, timeout: float) -> int:
        """Refuse new requests and wait up to `timeout` for those in flight; returns how many
        were still running when the time ran out."""
        self.draining = True
        log.info("draining: %d requests in flight, up to %.0f s", self.inflight, timeout)
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("drain timeout: %d requests still running are cut off", self.inflight)
        return self.inflight


class DrainMiddleware:
    """ASGI: counts HTTP requests in flight; while draining, answers new ones 503."""

    def __init__(self, app, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in _ALWAYS:
            return await self.app(scope, receive, send)
        if self.lifecycle.draining:
            body = error_body(
                "the server is shutting down (draining); retry on another instance",
                "service_unavailable",
                None,
                "draining",
            )
            headers = [(b"retry-after", b"1"), (b"connection", b"close")]
            await send_json(send, 503, body, headers)
            return
        self.lifecycle.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.inflight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the first SIGTERM / SIGINT starting a drain instead of an
    immediate shutdown; it exits 0 (uvicorn would re-raise the signal on its way out)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout_s: float):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.lifecycle.draining or self._loop is None:
            self.should_exit = True  # a second signal, or one before start-up: stop now
            return
        self.lifecycle.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self.lifecycle.drain(self.drain_timeout_s)
        self.should_exit = True
