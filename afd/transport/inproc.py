"""In-process backend: queues between threads of one process, tensors handed over as they are.

The FFN side runs on its own thread so that with S >= 2 micro-batches it computes while the
attention side works on the next micro-batch (torch releases the GIL inside its kernels). The
messages go through the same serving loop as on the network backends (validation, deadlines,
draining, traces, metrics); only the encoding is skipped.
"""

from __future__ import annotations

import queue
import threading
import time

from afd.errors import ConfigError
from afd.messages import FFNReply, FFNRequest
from afd.transport.base import FFNClient, Listener
from afd.transport.serving import FFNServing, stamp_received

# inproc:// names are process-local endpoints; this table is the only way two objects of one
# process find each other by address, exactly as a socket address does between processes.
_ENDPOINTS: dict[str, _InprocListener] = {}
_LOCK = threading.Lock()

Outbox = queue.SimpleQueue  # a client's reply queue: the peer a reply goes back to


class _InprocListener(Listener):
    def __init__(self, address: str, serving: FFNServing, inline: bool = False):
        self.address = address
        self._serving = serving
        self._inline = inline
        self._inbox: queue.SimpleQueue[tuple[Outbox, FFNRequest, float] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name=f"ffn:{address}", daemon=True)
        self._thread.start()

    def submit(self, req: FFNRequest, reply_to: Outbox) -> None:
        item = (reply_to, req, time.time())
        if self._inline:  # serial mode: compute on the caller's thread, no hand-off
            self._answer([item])
            return
        self._inbox.put(item)

    def _serve(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            batch = [item]
            # Take whatever else is already queued: one compute call per layer for all of it.
            while True:
                try:
                    nxt = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._inbox.put(None)
                    break
                batch.append(nxt)
            self._answer(batch)

    def _answer(self, batch: list[tuple[Outbox, FFNRequest, float]]) -> None:
        for reply_to, reply in self._serving.serve_requests(batch):
            reply_to.put(reply)

    def close(self) -> None:
        with _LOCK:
            if _ENDPOINTS.get(self.address) is self:
                del _ENDPOINTS[self.address]
        self._inbox.put(None)
        self._thread.join(timeout=5)


class _InprocClient(FFNClient):
    def __init__(self, address: str):
        super().__init__(address)
        self._replies: queue.SimpleQueue[FFNReply] = queue.SimpleQueue()

    def _listener(self) -> _InprocListener | None:
        with _LOCK:
            return _ENDPOINTS.get(self.address)

    def send(self, req: FFNRequest) -> bool:
        listener = self._listener()
        if listener is None:
            # Same as a network peer that is down: nobody took it.
            return False
        listener.submit(req, self._replies)
        return True

    def local(self) -> FFNServing | None:
        listener = self._listener()
        return listener._serving if listener is not None and listener._inline else None

    def _recv(self, timeout: float) -> FFNReply | None:
        try:
            return stamp_received(self._replies.get(timeout=min(timeout, 0.5)))
        except queue.Empty:
            return None


def listen(address: str, serving: FFNServing, *, inline: bool = False, **_: object) -> Listener:
    """inline=True computes each request on the sender's thread: no overlap, no thread hop
    (the right choice with one micro-batch, where there is nothing to overlap)."""
    with _LOCK:
        if address in _ENDPOINTS:
            raise ConfigError(f"{address} is already being served in this process")
        listener = _InprocListener(address, serving, inline)
        _ENDPOINTS[address] = listener
        return listener


def connect(address: str, **_: object) -> FFNClient:
    return _InprocClient(address)
