"""Async gRPC client to one attention server's control plane (Generate, Abort, Health, Stats).

Every call carries a deadline. Errors come back as `APIError`s with the HTTP status the
gateway answers with, so callers never see a grpc exception. The request, event, health and
load types and their protobuf conversions are the control plane's contract (`afd.control`),
shared with the attention server; it imports no torch, so neither does the gateway.
"""

from __future__ import annotations

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
from services.gateway.errors import APIError, PeerUnavailable, from_attention, unavailable

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Find a dead server on an idle connection without waiting for TCP's own timeouts.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def rpc_error(e: grpc.aio.AioRpcError, address: str) -> APIError:
    """A failed call as the error the HTTP client sees."""
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, f"attention server {address} did not answer in time", "timeout")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, f"attention server {address} is overloaded", "rate_limit_error")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        # Not reachable, or its process went away mid-call (server-side cancel at shutdown).
        return PeerUnavailable(f"attention server {address} is unavailable ({code.name})")
    return unavailable(f"attention server {address} is unavailable ({code.name})")


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
        iterator early cancels the call, which aborts the request on the server."""
        req = request_to_pb(GenerateRequest(request_id, prompt, params))
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
            raise rpc_error(e, self.address) from None
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

    async def stats(self) -> Stats:
        try:
            r = await self._stub.Stats(pb.StatsRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, self.address) from None
        return stats_from_pb(r)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel, self._stub_ = None, None
