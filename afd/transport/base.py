"""The transport interface: how an attention server reaches one FFN peer.

Contract, shared by every backend:
- `connect(address)` gives the attention side an `FFNClient`; `listen(address, serving)` gives
  the FFN side a `Listener` that hands what it receives to the one serving loop
  (`afd.transport.serving.FFNServing`: messages that arrived together and share a layer are
  computed as one batch) and sends each reply back to its sender.
- `send` never blocks on the peer's compute. `wait(seq, timeout)` returns the reply whose seq
  matches, buffering replies that arrive out of order, and raises `TransportError` when the
  deadline passes: a dead peer is an error for the request that needed it, never a hang.
- `send` may return False when the message certainly did not leave (no connected peer), so a
  caller with a spare replica need not wait out the deadline; None or True: it was queued.
- `lost_since(t)` says when the connection to the peer broke after monotonic time `t` (the peer
  died, or stopped answering the transport's own heartbeats): the replies to what was sent
  before then will never come, so the caller need not wait out its deadline. A blocking `poll`
  returns early when the connection breaks. Backends that cannot tell return "".
- Messages are never pickled; network backends use `afd.wire`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from afd.errors import TransportError
from afd.messages import FFNReply, FFNRequest

if TYPE_CHECKING:
    from afd.transport.serving import FFNServing


class FFNClient(ABC):
    def __init__(self, address: str):
        self.address = address
        self._early: dict[int, FFNReply] = {}
        self._floor = 0  # replies to messages below this seq are stale: dropped on arrival
        self._lost_at = 0.0  # monotonic: when the connection last broke (0: never)
        self._lost_why = ""

    @abstractmethod
    def send(self, req: FFNRequest) -> bool | None:
        """Queue one request to the peer; False if it certainly was not sent (see above)."""

    def try_send(self, req: FFNRequest) -> bool:
        """Send without waiting for a connection to come up (probes of a peer marked down);
        False if it could not be handed to a connected peer."""
        return self.send(req) is not False

    @abstractmethod
    def _recv(self, timeout: float) -> FFNReply | None:
        """The next reply from the peer, or None if none came within `timeout` seconds (0: do
        not wait); its trace.a_recv is stamped when it was received."""

    def lost_since(self, t: float) -> str:
        """Why the connection broke after monotonic time `t`, or "" if it has not."""
        self._watch()
        return self._lost_why if self._lost_at > t else ""

    def _watch(self) -> None:  # noqa: B027 - a backend that can see its connection reads it here
        """Take note of connection events that have happened (never blocks)."""

    def _connection_lost(self, why: str) -> None:
        """For backends: the connection broke now."""
        self._lost_at, self._lost_why = time.monotonic(), why

    def wait(self, seq: int, timeout: float) -> FFNReply:
        reply = self.poll(seq, timeout)
        if reply is None:
            raise TransportError(
                f"FFN peer {self.address} did not reply to message {seq} within {timeout:.1f}s"
            )
        return reply

    def poll(self, seq: int, timeout: float = 0.0) -> FFNReply | None:
        """The reply to `seq` if it is here or arrives within `timeout` seconds, else None.
        Replies to other messages that arrive meanwhile are kept for their own wait/poll."""
        if seq in self._early:
            return self._early.pop(seq)
        start = time.monotonic()
        deadline = start + timeout
        while True:
            reply = self._recv(max(0.0, deadline - time.monotonic()))
            if reply is not None and reply.seq >= self._floor:
                if reply.seq == seq:
                    return reply
                self._early[reply.seq] = reply
            elif time.monotonic() >= deadline or self.lost_since(start):
                return None

    @property
    def buffered(self) -> int:
        """Replies received and kept for a later wait/poll."""
        return len(self._early)

    def drain(self) -> None:
        """Take every reply that has already arrived, without waiting: each is stamped
        (trace.a_recv) when it is taken, so draining often keeps the stamps close to arrival."""
        while (reply := self._recv(0.0)) is not None:
            if reply.seq >= self._floor:
                self._early[reply.seq] = reply

    def reset(self, below: int = 0) -> None:
        """Forget replies of an abandoned step (after an error); with `below`, also every
        reply to a message numbered below it that is still to come (a peer given up on)."""
        self._early.clear()
        self._floor = max(self._floor, below)

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def local(self) -> FFNServing | None:
        """The peer's serving loop when it computes on the caller's own thread in this process
        (an inline in-process listener): the sender may call it directly
        (`FFNServing.serve_local`) instead of sending a message. None for every other peer."""
        return None


class Listener(ABC):
    address: str

    @abstractmethod
    def close(self) -> None:
        """Stop serving and release the address."""
