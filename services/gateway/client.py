"""Async gRPC client to one attention server's control plane (Session, Generate, Abort, Health,
Stats).

Every call carries a deadline (on a Session, each request its own). Errors come back as
`APIError`s with the HTTP status the gateway answers with, so callers never see a grpc
exception. The request, event, health and load types and their protobuf conversions are the
control plane's contract (`afd.control`), shared with the attention server; it imports no torch,
so neither does the gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from afd.control import (
    GenerateRequest,
    Health,
    SamplingParams,
    Stats,
    TokenEvent,
    event_from_pb,
    health_from_pb,
    pb,
    pb_grpc,
    request_to_pb,
    stats_from_pb,
)
from afd.security import Security, aio_channel
from services.gateway.errors import (
    APIError,
    PeerUnavailable,
    from_attention,
    rpc_error,
    unavailable,
)
from services.gateway.session import UNSUPPORTED, Session

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Find a dead server on an idle connection without waiting for TCP's own timeouts.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


_TIMED_OUT = object()  # a request's deadline passed


class AttentionClient:
    """One channel to one attention server. Safe to share between concurrent requests."""

    def __init__(
        self,
        address: str,
        rpc_timeout_s: float = 2.0,
        generate_timeout_s: float = 600,
        security: Security | None = None,
    ):
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.security = security  # TLS (mTLS with a client certificate) when configured
        self._channel: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.AttentionServiceStub | None = None
        self._session_: Session | None = None
        self._unary_only = False  # the server predates Session

    @property
    def _stub(self) -> pb_grpc.AttentionServiceStub:
        # Made on first use: a grpc.aio channel belongs to the event loop it was created in,
        # and the server's loop does not exist yet when the client is configured.
        if self._stub_ is None:
            self._channel = aio_channel(self.address, _CHANNEL_OPTIONS, self.security)
            self._stub_ = pb_grpc.AttentionServiceStub(self._channel)
        return self._stub_

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens; the last chunk has finish_reason set. Closing the
        iterator early aborts the request on the server. The request goes over this client's
        Session (opened on first use, reopened after it breaks), or a Generate call of its own
        where the server has no Session."""
        req = request_to_pb(GenerateRequest(request_id, prompt, params))
        if self._unary_only:
            async for ev in self._generate_unary(req):
                yield ev
            return
        session = self._session()
        queue = session.start(req)
        aio = asyncio.get_running_loop()
        # The request's deadline, as the Generate call's gRPC deadline was.
        timer = aio.call_later(self.generate_timeout_s, queue.put_nowait, _TIMED_OUT)
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is UNSUPPORTED:  # nothing was sent for it: go the old way
                    self._unary_only = True
                    finished = True
                    break
                if isinstance(item, APIError):
                    finished = True  # the Session is gone, and the request with it
                    raise item
                if item is _TIMED_OUT:
                    raise APIError(
                        504, f"attention server {self.address} did not answer in time", "timeout"
                    )
                ev = event_from_pb(item)
                if ev.failed:
                    finished = True
                    raise from_attention(ev.error_code, ev.error)
                finished = bool(ev.finish_reason)
                yield ev
                if finished:
                    return
        finally:
            timer.cancel()
            if finished:
                session.finished(request_id)
            else:
                session.abort(request_id)
        async for ev in self._generate_unary(req):
            yield ev

    def _session(self) -> Session:
        if self._session_ is None or not self._session_.open:
            self._session_ = Session(self._stub, self.address)
        return self._session_

    async def _generate_unary(self, req: pb.GenerateRequest) -> AsyncIterator[TokenEvent]:
        call = self._stub.Generate(req, timeout=self.generate_timeout_s)
        finished = False
        try:
            async for msg in call:
                ev = event_from_pb(msg)
                if ev.failed:
                    finished = True
                    raise from_attention(ev.error_code, ev.error)
                finished = bool(ev.finish_reason)
                yield ev
                if finished:
                    return
            raise unavailable(f"attention server {self.address} ended the stream early")
        except grpc.aio.AioRpcError as e:
            error = rpc_error(e, self.address)
            if isinstance(error, PeerUnavailable):
                self._unary_only = False  # it may come back upgraded: ask for a Session again
            raise error from None
        finally:
            if not finished:
                call.cancel()

    async def abort(self, request_id: str) -> None:
        try:
            await self._stub.Abort(
                pb.AbortRequest(request_id=request_id), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError:
            pass  # the server is gone, and the request with it

    async def health(self) -> Health:
        try:
            r = await self._stub.Health(pb.HealthRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, self.address) from None
        return health_from_pb(r)

    async def reset_prefix_cache(self) -> int:
        """Forget the server's cached prefixes; returns how many cached blocks it forgot."""
        try:
            r = await self._stub.ResetPrefixCache(
                pb.ResetPrefixCacheRequest(), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, self.address) from None
        return r.forgotten

    async def stats(self) -> Stats:
        try:
            r = await self._stub.Stats(pb.StatsRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, self.address) from None
        return stats_from_pb(r)

    async def close(self) -> None:
        if self._session_ is not None:
            await self._session_.close()
            self._session_ = None
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel, self._stub_ = None, None
