"""gRPC backend for grpc://host:port: one bidirectional Exchange stream per client.

Each Frame carries the same header and buffers as a ZeroMQ message (afd.wire). The client keeps
one stream open, read by a background thread that feeds a reply queue; when the stream breaks
(server restarted, deadline reached) the next send opens a new one on the same channel, which
reconnects by itself. Messages in flight on a broken stream are lost: their wait() times out.
Protobuf bytes fields cannot borrow memory, so this backend copies each buffer once per hop;
ZeroMQ is the fast path.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from afd.errors import ConfigError, TransportError
from afd.messages import FFNReply, FFNRequest
from afd.protos import ensure_generated
from afd.security import Security, add_port, channel
from afd.transport.base import FFNClient, Listener
from afd.transport.serving import FFNServing, Inbound, stamp_received
from afd.wire import Buffer, WireError, decode_reply, encode_request

ensure_generated()
from afd.v1 import ffn_pb2 as pb  # noqa: E402 - generated on first use just above
from afd.v1 import ffn_pb2_grpc as pb_grpc  # noqa: E402

log = logging.getLogger(__name__)

STREAM_DEADLINE_S = 3600.0  # every call has a deadline; a stream past it is reopened
MAX_STREAMS = 16  # concurrent client streams a server accepts (each holds a pool thread)
_MAX_REPLY_BYTES = 512 << 20
# Find a dead server on an idle stream without TCP's own timeouts (channel() adds the prompt
# reconnection every afd channel has).
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def _target(address: str) -> str:
    scheme, sep, rest = address.partition("://")
    if scheme != "grpc" or not sep or ":" not in rest:
        raise ConfigError(f"expected grpc://host:port, got {address!r}")
    return rest


def _frame(frames: list[Buffer]) -> pb.Frame:
    return pb.Frame(header=bytes(frames[0]), buffers=[bytes(b) for b in frames[1:]])


@dataclass
class _Stream:
    requests: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    call: grpc.Future | None = None
    reader: threading.Thread | None = None
    dead: bool = False

    def iterate(self):
        while (item := self.requests.get()) is not None:
            yield item


class GrpcClient(FFNClient):
    """A channel and one open Exchange stream to one FFN server. Used from one thread."""

    def __init__(
        self,
        address: str,
        stream_deadline: float = STREAM_DEADLINE_S,
        security: Security | None = None,
    ):
        super().__init__(address)
        self._deadline = stream_deadline
        options = _KEEPALIVE + [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", _MAX_REPLY_BYTES),
        ]
        self._channel = channel(_target(address), options, security)
        self._stub = pb_grpc.FFNServiceStub(self._channel)
        self._replies: queue.SimpleQueue[FFNReply | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stream: _Stream | None = None
        self._closed = False

    def _open(self) -> _Stream:
        stream = _Stream()
        stream.call = self._stub.Exchange(stream.iterate(), timeout=self._deadline)
        stream.reader = threading.Thread(
            target=self._read, args=(stream,), name=f"grpc-reader:{self.address}", daemon=True
        )
        stream.reader.start()
        return stream

    def _read(self, stream: _Stream) -> None:
        try:
            for frame in stream.call:
                try:
                    reply = decode_reply([frame.header, *frame.buffers])
                except WireError as e:
                    log.warning("malformed reply from %s ignored: %s", self.address, e)
                    continue
                self._replies.put(stamp_received(reply))
        except grpc.RpcError as e:
            if not self._closed:
                log.info("stream to %s ended: %s", self.address, e.code())
        finally:
            stream.dead = True
            stream.requests.put(None)  # ends the request iterator gRPC is draining
            if not self._closed:  # what was sent on this stream will not be answered
                self._connection_lost(f"the stream to {self.address} ended")
                self._replies.put(None)  # wakes a poll waiting on it

    def send(self, req: FFNRequest) -> None:
        self.send_frames(encode_request(req))

    def send_frames(self, frames: list[Buffer]) -> None:
        """Send raw frames (tools and fault tests use this directly)."""
        with self._lock:
            if self._closed:
                raise TransportError(f"client for {self.address} is closed")
            if self._stream is None or self._stream.dead:
                self._stream = self._open()
            stream = self._stream
        stream.requests.put(_frame(frames))

    def _recv(self, timeout: float) -> FFNReply | None:
        try:
            return self._replies.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.call.cancel()
            stream.requests.put(None)
            stream.reader.join(timeout=5)
        self._channel.close()


class _Servicer(pb_grpc.FFNServiceServicer):
    def __init__(self, inbox: queue.SimpleQueue):
        self._inbox = inbox

    def Exchange(self, request_iterator, context):  # noqa: N802 - gRPC's method name
        replies: queue.SimpleQueue = queue.SimpleQueue()  # this stream's outbox; also its peer id
        context.add_callback(lambda: replies.put(None))

        def read() -> None:
            # gRPC's sync API gives one thread per call; reading needs a second to write meanwhile.
            try:
                for frame in request_iterator:
                    msg = Inbound(replies, [frame.header, *frame.buffers], time.time())
                    self._inbox.put(msg)
            except Exception as e:  # cancelled or broken stream
                log.debug("grpc stream from %s ended: %s", context.peer(), e)
            finally:
                replies.put(None)

        threading.Thread(target=read, name="grpc-stream-reader", daemon=True).start()
        while (frames := replies.get()) is not None:
            yield _frame(frames)


class GrpcListener(Listener):
    """A gRPC server whose stream threads feed one compute thread (batching across clients)."""

    def __init__(self, address: str, serving: FFNServing, security: Security | None = None):
        self._serving = serving
        limits = serving.limits
        self._inbox: queue.SimpleQueue[Inbound | None] = queue.SimpleQueue()
        max_request = limits.max_tokens * (limits.hidden_size * 4 + 4 + 8 * limits.top_k) + 65536
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=MAX_STREAMS, thread_name_prefix="grpc-ffn"),
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_request)],
            maximum_concurrent_rpcs=MAX_STREAMS,
        )
        pb_grpc.add_FFNServiceServicer_to_server(_Servicer(self._inbox), self._server)
        target = _target(address)
        try:
            port = add_port(self._server, target, security)
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            port = 0
        if not port:
            raise TransportError(f"cannot listen on {address} (address in use?)")
        self.address = f"grpc://{target.rsplit(':', 1)[0]}:{port}"
        self._server.start()
        self._thread = threading.Thread(target=self._serve, name=f"ffn:{self.address}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            batch = [self._inbox.get()]
            while len(batch) < 256:  # take what else has already arrived: one batch per layer
                try:
                    batch.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            messages = [m for m in batch if m is not None]
            try:
                for outbox, frames in self._serving.serve_frames(messages):
                    outbox.put(frames)
            except Exception:
                log.exception("grpc listener %s: error in the serving loop", self.address)
            if len(messages) != len(batch):
                return

    def close(self) -> None:
        self._server.stop(grace=0).wait(5)
        self._inbox.put(None)
        self._thread.join(timeout=10)


def connect(
    address: str,
    *,
    stream_deadline: float = STREAM_DEADLINE_S,
    security: Security | None = None,
    **_: object,
) -> FFNClient:
    return GrpcClient(address, stream_deadline=stream_deadline, security=security)


def listen(
    address: str, serving: FFNServing, *, security: Security | None = None, **_: object
) -> Listener:
    return GrpcListener(address, serving, security)
