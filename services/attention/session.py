"""One gateway's Session stream on the attention server: requests and aborts come in, and the
events of each engine step for this stream's requests go out as one `TokenEvents` message.

A gateway keeps one Session per attention server instead of a Generate call per request, so a
step at 32 streams costs the server's event loop one send instead of 32. The requests are the
same as Generate's (the servicer admits or refuses each), and so are their events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

from afd.control import GenerateRequest, TokenEvent, event_to_pb, pb
from afd.errors import ErrorCode

log = logging.getLogger("afd.attention")


@dataclass(frozen=True)
class _Refused:
    """An event that refuses a request before it started: sent, but no live request ends."""

    event: TokenEvent


class Outbox:
    """A Session's events waiting to be sent. The server's mailbox hands a whole step's events
    over in one loop callback, so the writer wakes once a step and sends them together."""

    def __init__(self) -> None:
        self._items: list[TokenEvent | _Refused] = []
        self._ready = asyncio.Event()
        self.closed = False  # the gateway sends no more requests

    def put_nowait(self, ev: TokenEvent | _Refused) -> None:  # the mailbox's interface
        self._items.append(ev)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def take(self) -> list[TokenEvent | _Refused]:
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, []
        return items


class Admission(Protocol):
    """What a Session needs of the servicer that owns the engine loop."""

    active: int  # requests in progress on this server (drain waits for 0)

    def admit(self, request: pb.GenerateRequest) -> GenerateRequest | TokenEvent:
        """The request to run, or the failure event that refuses it (draining, invalid)."""
        ...

    def start(self, request: GenerateRequest, outbox: Outbox) -> None:
        """Submit to the engine; its events go to `outbox`."""
        ...

    def abort(self, request_id: str) -> None: ...


# A message's events, serialized, at most (but one event alone may be larger): a step's events
# with prompt logprobs can be large, and the gateway's channel takes messages up to 64 MiB.
MESSAGE_BYTES = 4 << 20
_SMALL_EVENT = 64  # bytes counted for an event without logprobs (a few token ids and counts)


def messages(events: list[TokenEvent]) -> Iterator[pb.TokenEvents]:
    """A step's events in as few messages as MESSAGE_BYTES allows, in order."""
    chunk: list[pb.TokenEvent] = []
    size = 0
    for ev in events:
        msg = event_to_pb(ev)
        n = msg.ByteSize() if ev.logprobs or ev.prompt_logprobs else _SMALL_EVENT
        if chunk and size + n > MESSAGE_BYTES:
            yield pb.TokenEvents(events=chunk)
            chunk, size = [], 0
        chunk.append(msg)
        size += n
    if chunk:
        yield pb.TokenEvents(events=chunk)


class SessionStream:
    """Serves one Session call: `events()` is the response stream."""

    def __init__(self, owner: Admission, requests: AsyncIterator[pb.SessionIn]):
        self._owner = owner
        self._requests = requests
        self._out = Outbox()
        self._live: set[str] = set()  # started here, final event not sent yet

    def finish(self) -> None:
        """End the stream once the requests running on it have ended (the server drains)."""
        self._out.close()

    async def events(self) -> AsyncIterator[pb.TokenEvents]:
        reader = asyncio.create_task(self._read())
        try:
            while True:
                batch = await self._out.take()
                for msg in messages([self._account(item) for item in batch]):
                    yield msg
                if self._out.closed and not self._live:
                    return  # the gateway half-closed and everything it started has ended
        finally:
            reader.cancel()
            # The gateway went away (or the server is stopping): free the KV blocks now.
            for rid in self._live:
                self._owner.abort(rid)
            self._owner.active -= len(self._live)
            self._live.clear()

    def _account(self, item: TokenEvent | _Refused) -> TokenEvent:
        if isinstance(item, _Refused):
            return item.event
        if item.finish_reason and item.request_id in self._live:
            self._live.remove(item.request_id)
            self._owner.active -= 1
        return item

    async def _read(self) -> None:
        try:
            async for msg in self._requests:
                kind = msg.WhichOneof("kind")
                if kind == "generate":
                    self._start(msg.generate)
                elif kind == "abort" and msg.abort.request_id in self._live:
                    self._owner.abort(msg.abort.request_id)  # its "abort" event ends it
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream broke: the call itself ends with it
            log.debug("session stream closed: %s", e)
        finally:
            self._out.close()

    def _start(self, msg: pb.GenerateRequest) -> None:
        rid = msg.request_id
        if rid in self._live:
            why = f"request id {rid!r} is already running on this session"
            self._refuse(TokenEvent.failure(rid, ErrorCode.INVALID_REQUEST, why))
            return
        admitted = self._owner.admit(msg)
        if isinstance(admitted, TokenEvent):
            self._refuse(admitted)
            return
        self._live.add(rid)
        self._owner.active += 1
        self._owner.start(admitted, self._out)

    def _refuse(self, ev: TokenEvent) -> None:
        self._out.put_nowait(_Refused(ev))
