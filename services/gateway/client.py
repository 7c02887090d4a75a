"""Async gRPC client to one attention server's control plane (Generate, Abort, Health, Stats).

Every call carries a deadline. Errors come back as `APIError`s with the HTTP status the
gateway answers with, so callers never see a grpc exception. This module (with
services/attention/control.py on the server side) is the only one importing control_pb2; it
converts on its own so the gateway never imports the engine (and torch).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from afd.protos import ensure_generated
from afd.security import Security, aio_channel
from services.gateway.errors import APIError, PeerUnavailable, from_attention, unavailable

ensure_generated()

from afd.v1 import control_pb2 as pb  # noqa: E402
from afd.v1 import control_pb2_grpc as pb_grpc  # noqa: E402

_ERROR_NAMES = {
    pb.ERROR_INVALID_REQUEST: "invalid_request",
    pb.ERROR_UNAVAILABLE: "unavailable",
    pb.ERROR_OVERLOADED: "overloaded",
    pb.ERROR_INTERNAL: "internal",
}
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Find a dead server on an idle connection without waiting for TCP's own timeouts.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclass(frozen=True)
class GenParams:
    """Sampling parameters as the attention server takes them."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k


@dataclass(frozen=True)
class TokenChunk:
    """One TokenEvent: the tokens one engine step gave a request."""

    token_ids: list[int]
    # per token: (logprob of the sampled token, [(token id, logprob)] top alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0


@dataclass(frozen=True)
class Health:
    live: bool
    ready: bool
    reason: str
    model: str
    max_model_len: int
    draining: bool = False


@dataclass(frozen=True)
class Stats:
    running: int
    waiting: int
    kv_usage: float
    draining: bool = False  # shutting down: send it nothing new


def _params_to_pb(p: GenParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def _chunk(ev: pb.TokenEvent) -> TokenChunk:
    return TokenChunk(
        token_ids=list(ev.token_ids),
        logprobs=[(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in ev.logprobs],
        finish_reason=ev.finish_reason,
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        queue_seconds=ev.queue_seconds,
    )


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
        self, request_id: str, prompt: list[int], params: GenParams
    ) -> AsyncIterator[TokenChunk]:
        """Stream the request's tokens; the last chunk has finish_reason set. Closing the
        iterator early cancels the call, which aborts the request on the server."""
        req = pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=_params_to_pb(params)
        )
        call = self._stub.Generate(req, timeout=self.generate_timeout_s)
        finished = False
        try:
            async for ev in call:
                if ev.error_code != pb.ERROR_NONE or ev.finish_reason == "error":
                    name = _ERROR_NAMES.get(ev.error_code, "internal")
                    finished = True
                    raise from_attention(name, ev.error)
                chunk = _chunk(ev)
                finished = bool(chunk.finish_reason)
                yield chunk
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
        return Health(r.live, r.ready, r.reason, r.model, r.max_model_len, r.draining)

    async def stats(self) -> Stats:
        try:
            r = await self._stub.Stats(pb.StatsRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, self.address) from None
        return Stats(r.running, r.waiting, r.kv_usage, r.draining)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel, self._stub_ = None, None
