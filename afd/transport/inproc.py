"""In-process backend: queues between threads of one process, tensors handed over as they are.

The FFN side runs on its own thread so that with S >= 2 micro-batches it computes while the
attention side works on the next micro-batch (torch releases the GIL inside its kernels).
"""

from __future__ import annotations

import queue
import threading

from afd.errors import ConfigError
from afd.transport.base import FFNClient, Handler, Listener
from afd.transport.messages import FFNReply, FFNRequest
from afd.transport.serving import stamp_received

# inproc:// names are process-local endpoints; this table is the only way two objects of one
# process find each other by address, exactly as a socket address does between processes.
_ENDPOINTS: dict[str, _InprocListener] = {}
_LOCK = threading.Lock()


class _InprocListener(Listener):
    def __init__(self, address: str, handler: Handler, inline: bool = False):
        self.address = address
        self._handler = handler
        self._inline = inline
        self._inbox: queue.SimpleQueue[tuple[FFNRequest, queue.SimpleQueue] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name=f"ffn:{address}", daemon=True)
        self._thread.start()

    def submit(self, req: FFNRequest, reply_to: queue.SimpleQueue) -> None:
        if self._inline:  # serial mode: compute on the caller's thread, no hand-off
            for reply in self._handler([req]):
                reply_to.put(reply)
            return
        self._inbox.put((req, reply_to))

    def _serve(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            batch = [item]
            # Merge whatever else is already queued for the same layer into one compute call.
            while True:
                try:
                    nxt = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._inbox.put(None)
                    break
                batch.append(nxt)
            for group in _by_layer(batch):
                reqs = [r for r, _ in group]
                replies = self._handler(reqs)
                for (_, reply_to), reply in zip(group, replies, strict=True):
                    reply_to.put(reply)

    def close(self) -> None:
        with _LOCK:
            if _ENDPOINTS.get(self.address) is self:
                del _ENDPOINTS[self.address]
        self._inbox.put(None)
        self._thread.join(timeout=5)


def _by_layer(batch):
    groups: dict[int, list] = {}
    for item in batch:
        groups.setdefault(item[0].layer, []).append(item)
    return list(groups.values())


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

    def _recv(self, timeout: float) -> FFNReply | None:
        try:
            return stamp_received(self._replies.get(timeout=min(timeout, 0.5)))
        except queue.Empty:
            return None


def listen(address: str, handler: Handler, *, inline: bool = False, **_: object) -> Listener:
    """inline=True computes each request on the sender's thread: no overlap, no thread hop
    (the right choice with one micro-batch, where there is nothing to overlap)."""
    with _LOCK:
        if address in _ENDPOINTS:
            raise ConfigError(f"{address} is already being served in this process")
        listener = _InprocListener(address, handler, inline)
        _ENDPOINTS[address] = listener
        return listener


def connect(address: str, **_: object) -> FFNClient:
    return _InprocClient(address)
