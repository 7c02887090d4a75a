"""The attention server process: the engine loop plus the gRPC control plane.

`afd attention --model DIR --ffn ADDR[|REPLICA...][,ADDR...] --listen HOST:PORT`

On SIGTERM the server drains: a new request (Generate or on a Session) is answered
ERROR_UNAVAILABLE ("draining") at once, Health and /ready say not ready, Stats says draining
(the gateway stops routing here), and the requests in flight run to their end, up to the drain
timeout; then it exits 0. A second SIGTERM stops it at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from dataclasses import dataclass, field, replace

import grpc
from prometheus_client import REGISTRY

from afd import metrics, sidecar
from afd.config import EngineConfig, check
from afd.control import (
    GenerateRequest,
    Health,
    TokenEvent,
    event_to_pb,
    health_to_pb,
    pb,
    pb_grpc,
    request_from_pb,
    stats_to_pb,
)
from afd.errors import ErrorCode, RequestError, TransportError
from afd.expert_load import ExpertLoadCollector
from afd.runtime import freeze_startup_heap, on_own_thread
from afd.security import add_port
from afd.sidecar import SidePortConfig
from services.attention.engine import Engine
from services.attention.loop import EngineLoop
from services.attention.session import Outbox, SessionStream
from services.attention.stragglers import StragglerConfig
from services.attention.telemetry import EngineTelemetry

log = logging.getLogger("afd.attention")


@dataclass(frozen=True)
class AttentionServerConfig:
    engine: EngineConfig
    listen: str = "127.0.0.1:50051"  # control plane (gRPC), host:port
    model_name: str = ""
    ready_cache_s: float = 1.0  # how long a readiness answer is reused
    side: SidePortConfig = field(default_factory=SidePortConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    # On SIGTERM: refuse new requests and let those in flight finish for up to this long.
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check(":" in self.listen, f"--listen must be host:port, got {self.listen!r}")
        check(
            self.drain_timeout_s >= 0, f"the drain timeout must be >= 0, got {self.drain_timeout_s}"
        )


class _Mailbox:
    """Token events from the engine thread to the asyncio loop with one wake-up per burst: a step
    publishes an event for every running request, and a wake-up each (a write to the loop's
    self-pipe, a callback) would cost the engine thread the GIL 32 times a step at 32 streams."""

    def __init__(self, aio: asyncio.AbstractEventLoop):
        self._aio = aio
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue | Outbox, TokenEvent]] = []

    def post(self, queue: asyncio.Queue | Outbox, ev: TokenEvent) -> None:  # any thread
        with self._lock:
            wake = not self._items
            self._items.append((queue, ev))
        if wake:
            self._aio.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, []
        for queue, ev in items:
            queue.put_nowait(ev)


class ControlServicer(pb_grpc.AttentionServiceServicer):
    def __init__(self, loop: EngineLoop, cfg: AttentionServerConfig):
        self.loop = loop
        self.cfg = cfg
        self._ready: tuple[float, bool, str] = (0.0, False, "not probed yet")
        self._probing = None  # the readiness probe queued on the engine thread, if any
        self.draining = False
        self.active = 0  # requests in progress (Generate calls and Sessions' requests)
        self._mailbox: _Mailbox | None = None  # made on the loop, by the first request
        self._sessions: set[SessionStream] = set()  # the gateways' open Session calls

    async def Generate(self, request, context):
        admitted = self.admit(request)
        if isinstance(admitted, TokenEvent):
            yield event_to_pb(admitted)
            return
        self.active += 1
        try:
            async for ev in self._generate(admitted):
                yield ev
        finally:
            self.active -= 1

    async def Session(self, request_iterator, context):
        session = SessionStream(self, request_iterator)
        self._sessions.add(session)
        try:
            async for msg in session.events():
                yield msg
        finally:
            self._sessions.discard(session)

    # ---- what both Generate and Session do with a request (session.Admission) ----

    def admit(self, request) -> GenerateRequest | TokenEvent:
        """The request to run, or the failure event that refuses it."""
        rid = request.request_id
        if self.draining:
            why = f"attention server {self.cfg.listen} is draining (shutting down); retry"
            return TokenEvent.failure(rid, ErrorCode.UNAVAILABLE, why)
        try:
            return request_from_pb(request)
        except RequestError as e:
            return TokenEvent.failure(rid, e.code, str(e))

    def start(self, request: GenerateRequest, events: asyncio.Queue | Outbox) -> None:
        """Submit to the engine; its events are put on `events` (an asyncio.Queue or a
        Session's outbox) on this loop, a step's events in one wake-up."""
        if self._mailbox is None:
            self._mailbox = _Mailbox(asyncio.get_running_loop())
        mailbox = self._mailbox
        self.loop.submit(
            request.request_id,
            request.prompt_token_ids,
            request.sampling,
            lambda ev: mailbox.post(events, ev),
        )

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    async def _generate(self, request: GenerateRequest):
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        rid = request.request_id
        self.start(request, events)
        finished = False
        try:
            while not finished:
                ev = await events.get()
                finished = bool(ev.finish_reason)
                yield event_to_pb(ev)
        finally:
            if not finished:  # the client went away: free the request's KV blocks now
                self.loop.abort(rid)

    async def Abort(self, request, context):
        found = await asyncio.wrap_future(self.loop.abort(request.request_id))
        return pb.AbortReply(found=found)

    async def Health(self, request, context):
        ready, reason = await self._readiness()
        eng = self.loop.engine
        return health_to_pb(
            Health(True, ready, reason, self.cfg.model_name, eng.max_model_len, self.draining)
        )

    async def Stats(self, request, context):
        return stats_to_pb(replace(self.loop.engine.load(), draining=self.draining))

    async def ResetPrefixCache(self, request, context):
        blocks = self.loop.engine.blocks  # on the engine thread: between steps
        forgotten = await asyncio.wrap_future(self.loop.call(blocks.reset_cache))
        log.info("prefix cache reset: %d cached blocks forgotten", forgotten)
        return pb.ResetPrefixCacheReply(forgotten=forgotten)

    async def drain(self, timeout: float) -> int:
        """Refuse new requests and wait (up to `timeout`) for those in flight; returns how
        many were still running when the time ran out."""
        self.draining = True
        log.info("draining: %d requests in flight, up to %.0f s", self.active, timeout)
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("drain timeout: %d requests still running are cut off", self.active)
        for session in self._sessions:
            session.finish()  # ends each (cleanly) once its requests have, so the stop is quick
        return self.active

    async def _readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        # Shielded: a cancelled Health call must not cancel the probe others share.
        return await asyncio.shield(asyncio.wrap_future(self.readiness_future()))

    def readiness(self, timeout: float = 5.0) -> tuple[bool, str]:
        """For the HTTP side port's thread."""
        if self.draining:
            return False, "draining"
        return self.readiness_future().result(timeout)

    def readiness_future(self):
        """Ready = the FFN pool answers (every shard, so every expert is covered); cached."""
        from concurrent.futures import Future

        t, ready, reason = self._ready
        # A peer marked down since (a failed step) makes the cached answer stale.
        fresh = self.loop.engine.ffn_all_up
        if fresh and time.monotonic() - t < self.cfg.ready_cache_s:
            fut: Future = Future()
            fut.set_result((ready, reason))
            return fut
        if self._probing is not None and not self._probing.done():
            return self._probing  # one probe at a time: callers share it, never queue more

        def probe() -> tuple[bool, str]:
            try:
                self.loop.engine.check_ffn(2.0)
                result = (True, "")
            except TransportError as e:
                result = (False, f"FFN pool does not cover every expert: {e}")
            self._ready = (time.monotonic(), *result)
            return result

        self._probing = self.loop.call(probe)
        return self._probing


async def _serve(cfg: AttentionServerConfig) -> None:
    engine = on_own_thread(Engine, cfg.engine)  # the engine thread's OpenMP pool the only one
    metrics.register("attention")
    moe = [i for i in range(cfg.engine.model.num_layers) if cfg.engine.model.is_moe(i)]
    REGISTRY.register(ExpertLoadCollector(lambda: engine.expert_load, moe))
    loop = EngineLoop(engine, EngineTelemetry(engine.ffn_addresses, cfg.stragglers))
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = ControlServicer(loop, cfg)
    pb_grpc.add_AttentionServiceServicer_to_server(servicer, server)
    # The control plane uses the same TLS settings as the data plane (one cert per server).
    port = add_port(server, cfg.listen, cfg.engine.security)
    if port == 0:
        raise TransportError(f"cannot listen on {cfg.listen}")
    freeze_startup_heap()
    await server.start()
    side = sidecar.start(cfg.side, servicer.readiness)
    log.info(
        "attention server listening on %s (FFN pool: %s)",
        cfg.listen,
        f"elastic, from {cfg.engine.ffn_pool}"
        if cfg.engine.ffn_pool
        else ", ".join(cfg.engine.ffn_addresses),
    )
    stop, now = asyncio.Event(), asyncio.Event()
    aio = asyncio.get_running_loop()

    def on_signal() -> None:
        (now if stop.is_set() else stop).set()  # the second signal: stop without draining

    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, on_signal)
    await stop.wait()
    drain = asyncio.ensure_future(servicer.drain(cfg.drain_timeout_s))
    await asyncio.wait([drain, asyncio.ensure_future(now.wait())], return_when="FIRST_COMPLETED")
    log.info("attention server stopping")
    await server.stop(grace=1.0)
    loop.close()
    if side:
        side.close()


def serve(cfg: AttentionServerConfig) -> int:
    asyncio.run(_serve(cfg))
    return 0
