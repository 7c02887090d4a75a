"""The gateway's end of a Session with one attention server: many requests over one gRPC
stream, each engine step's events for all of them in one message, handed out per request.

A Session that breaks (the server went away, the connection dropped) ends every request on it
with the same error, and the client opens a new one for the next request. The server's answer
that it has no Session (an older release during a rolling upgrade) is `UNSUPPORTED`; the client
then uses a Generate call per request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from afd.control import pb, pb_grpc
from services.gateway.errors import APIError, internal, rpc_error, unavailable

UNSUPPORTED = object()  # the server answered UNIMPLEMENTED: it predates Session

# What a request's queue receives: a pb.TokenEvent, or once the Session has ended, an
# APIError (or UNSUPPORTED) that ends the request too.
Item = object


class Session:
    """One open Session call. Made and used on one event loop."""

    def __init__(self, stub: pb_grpc.AttentionServiceStub, address: str):
        self.address = address
        self._sends: asyncio.Queue[pb.SessionIn | None] = asyncio.Queue()
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        # No deadline on the stream itself: it lives as long as the channel. Each request
        # carries its own (AttentionClient.generate), and keepalive pings find a dead server.
        self._call = stub.Session(self._outgoing())
        self.ended: APIError | object | None = None  # why it takes no more requests
        self._reader = asyncio.create_task(self._read())

    @property
    def open(self) -> bool:
        return self.ended is None

    def start(self, request: pb.GenerateRequest) -> asyncio.Queue[Item]:
        """Send the request; its events will arrive on the queue returned."""
        rid = request.request_id
        if rid in self._queues:
            raise internal(f"request id {rid!r} is already running on {self.address}")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[rid] = queue
        self._sends.put_nowait(pb.SessionIn(generate=request))
        return queue

    def finished(self, request_id: str) -> None:
        """The request's last event has been read: forget it."""
        self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request the caller no longer reads; its remaining events are dropped."""
        if self._queues.pop(request_id, None) is not None and self.open:
            self._sends.put_nowait(pb.SessionIn(abort=pb.AbortRequest(request_id=request_id)))

    async def _outgoing(self) -> AsyncIterator[pb.SessionIn]:
        while (msg := await self._sends.get()) is not None:
            yield msg

    async def _read(self) -> None:
        why: APIError | object = unavailable(
            f"attention server {self.address} ended the stream early"
        )
        try:
            async for msg in self._call:
                for ev in msg.events:
                    queue = self._queues.get(ev.request_id)
                    if queue is not None:  # None: aborted here, its last events in flight
                        queue.put_nowait(ev)
        except grpc.aio.AioRpcError as e:
            unsupported = e.code() == grpc.StatusCode.UNIMPLEMENTED
            why = UNSUPPORTED if unsupported else rpc_error(e, self.address)
        except asyncio.CancelledError:
            why = unavailable(f"the stream to attention server {self.address} was closed")
            raise
        finally:
            self.ended = why
            for queue in self._queues.values():
                queue.put_nowait(why)
            self._queues.clear()

    async def close(self) -> None:
        self._sends.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
