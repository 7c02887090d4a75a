"""The attention server process: the engine loop plus the gRPC control plane.

`afd attention --model DIR --ffn ADDR[,ADDR...] --listen HOST:PORT`
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

import grpc

from afd import metrics, sidecar
from afd.config import EngineConfig
from afd.errors import TransportError
from afd.security import add_port
from services.attention.control import event_to_pb, pb, pb_grpc, sampling_from_pb
from services.attention.engine import Engine
from services.attention.loop import EngineLoop, Event
from services.attention.stragglers import StragglerConfig
from services.attention.telemetry import EngineTelemetry

log = logging.getLogger("afd.attention")


@dataclass(frozen=True)
class AttentionServerConfig:
    engine: EngineConfig
    listen: str = "127.0.0.1:50051"  # control plane (gRPC)
    model_name: str = ""
    ready_cache_s: float = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # HTTP /metrics, /health, /ready; 0: off
    stragglers: StragglerConfig = StragglerConfig()


class ControlServicer(pb_grpc.AttentionServiceServicer):
    def __init__(self, loop: EngineLoop, cfg: AttentionServerConfig):
        self.loop = loop
        self.cfg = cfg
        self._ready: tuple[float, bool, str] = (0.0, False, "not probed yet")

    async def Generate(self, request, context):
        aio = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        rid = request.request_id
        self.loop.submit(
            rid,
            list(request.prompt_token_ids),
            sampling_from_pb(request.sampling),
            lambda ev: aio.call_soon_threadsafe(events.put_nowait, ev),
        )
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
        self.loop.abort(request.request_id)
        return pb.AbortReply(found=True)

    async def Health(self, request, context):
        ready, reason = await self._readiness()
        eng = self.loop.engine
        return pb.HealthReply(
            live=True,
            ready=ready,
            reason=reason,
            model=self.cfg.model_name,
            max_model_len=eng.max_model_len,
        )

    async def Stats(self, request, context):
        eng = self.loop.engine
        s = eng.scheduler
        return pb.StatsReply(
            running=s.num_running,
            waiting=s.num_waiting,
            kv_usage=eng.blocks.usage,
            preemptions=s.num_preemptions,
        )

    async def _readiness(self) -> tuple[bool, str]:
        return await asyncio.wrap_future(self.readiness_future())

    def readiness(self, timeout: float = 5.0) -> tuple[bool, str]:
        """For the HTTP side port's thread."""
        return self.readiness_future().result(timeout)

    def readiness_future(self):
        """Ready = the FFN pool answers (every shard, so every expert is covered); cached."""
        from concurrent.futures import Future

        t, ready, reason = self._ready
        if time.monotonic() - t < self.cfg.ready_cache_s:
            fut: Future = Future()
            fut.set_result((ready, reason))
            return fut

        def probe() -> tuple[bool, str]:
            try:
                self.loop.engine.pool.ping(2.0)
                result = (True, "")
            except TransportError as e:
                result = (False, f"FFN pool does not cover every expert: {e}")
            self._ready = (time.monotonic(), *result)
            return result

        return self.loop.call(probe)


def _start_inproc_ffn(cfg: EngineConfig) -> list:
    """When every FFN address is inproc://, serve those expert shards in this process (shard i
    of N at the i-th address): `afd serve --transport inproc`."""
    addrs = cfg.ffn_addresses
    if not addrs or not all(a.startswith("inproc://") for a in addrs):
        return []
    from afd.sharding import ExpertShard
    from afd.transport import listen
    from services.attention.engine import DTYPES
    from services.ffn.server import FFNServer

    n, model = len(addrs), cfg.model
    return [
        listen(
            addr,
            FFNServer(model, ExpertShard(i, n, model.num_experts), DTYPES[cfg.dtype]).handle,
            inline=cfg.micro_batches == 1,  # nothing to overlap: compute on the engine thread
        )
        for i, addr in enumerate(addrs)
    ]


async def _serve(cfg: AttentionServerConfig) -> None:
    ffn_listeners = _start_inproc_ffn(cfg.engine)
    engine = Engine(cfg.engine)
    metrics.register("attention")
    loop = EngineLoop(engine, EngineTelemetry(engine, cfg.stragglers))
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = ControlServicer(loop, cfg)
    pb_grpc.add_AttentionServiceServicer_to_server(servicer, server)
    # The control plane uses the same TLS settings as the data plane (one cert per server).
    port = add_port(server, cfg.listen, cfg.engine.security)
    if port == 0:
        raise TransportError(f"cannot listen on {cfg.listen}")
    await server.start()
    side = sidecar.start(cfg.metrics_host, cfg.metrics_port, servicer.readiness)
    log.info(
        "attention server listening on %s (FFN pool: %s)",
        cfg.listen,
        ", ".join(cfg.engine.ffn_addresses),
    )
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("attention server stopping")
    await server.stop(grace=2.0)
    loop.close()
    if side:
        side.close()
    for listener in ffn_listeners:
        listener.close()


def serve(cfg: AttentionServerConfig) -> int:
    asyncio.run(_serve(cfg))
    return 0
