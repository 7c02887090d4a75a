"""ZeroMQ backend for tcp://host:port and ipc://path: multipart frames, zero-copy.

The attention side holds a DEALER socket connected to the FFN server's ROUTER; a message is
the header frame plus one frame per tensor buffer (afd.wire), and a reply comes back the same
way. ZeroMQ reconnects by itself when the FFN process restarts on the same address; the socket
options below make a request sent while no peer is connected fail fast (it is dropped and its
wait() times out) instead of waiting in a queue to be delivered, stale, after the restart.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
import zmq.utils.monitor

from afd.errors import TransportError
from afd.messages import FFNReply, FFNRequest
from afd.security import Security
from afd.transport.base import FFNClient, Listener
from afd.transport.serving import FFNServing, Inbound, stamp_received
from afd.wire import Buffer, WireError, decode_reply, encode_request

log = logging.getLogger(__name__)

HWM = 1024  # messages queued per peer before sends fail (sender) or replies drop (server)
RECONNECT_IVL_MS = 50
RECONNECT_IVL_MAX_MS = 500  # retry a restarted peer at least twice a second
# ZMTP pings find a peer that hangs or vanished without closing its socket within ~1.5 s. They
# are answered by ZeroMQ's own I/O thread, so a peer busy computing (a long prefill) still does.
HEARTBEAT_IVL_MS = 500
HEARTBEAT_TIMEOUT_MS = 1500
_DRAIN = 256  # messages taken per wake-up, so one burst cannot starve the reply path
_POLL_MS = 50  # how often the serving thread checks for close()


def _common_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # close() never waits on an unreachable peer
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def _curve_client(sock: zmq.Socket, security: Security) -> None:
    public, secret = security.curve_keys("client")
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = security.server_public_key()


def _curve_server(ctx: zmq.Context, sock: zmq.Socket, security: Security):
    """CURVE on the server socket, and a ZAP authenticator that admits only the client keys in
    the authorized/ directory; returns the authenticator (stop it on close)."""
    from zmq.auth.thread import ThreadAuthenticator

    public, secret = security.curve_keys("server")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=security.authorized_dir)
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True
    return auth


class ZmqClient(FFNClient):
    """One DEALER socket to one FFN server. Used from one thread (like the engine loop)."""

    def __init__(self, address: str, connect_grace: float = 0.5, security: Security | None = None):
        super().__init__(address)
        self._grace = connect_grace
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        _common_options(self._sock)
        if security is not None and security.curve:
            _curve_client(self._sock, security)
        # IMMEDIATE: queue only on completed connections, so nothing waits for a dead peer.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        # The socket's own events say when the peer went away: a closed connection (the
        # process died) or missed heartbeats (it hangs), within about a second.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def send(self, req: FFNRequest) -> bool:
        """Send one request. Its tensors are sent zero-copy: do not modify them until the reply
        arrives. A request that cannot be handed to a connected peer within `connect_grace`
        (or its deadline) is dropped (False), and wait() on it times out."""
        grace = self._grace
        if req.deadline:
            grace = max(0.0, min(grace, req.deadline - time.time()))
        return self.send_frames(encode_request(req), grace)

    def try_send(self, req: FFNRequest) -> bool:
        return self.send_frames(encode_request(req), 0.0)

    def send_frames(self, frames: list[Buffer], grace: float | None = None) -> bool:
        """Send raw frames (tools and fault tests use this directly); False if dropped."""
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            pass
        # No connected peer yet (just connected, or it restarted): wait briefly for one.
        grace = self._grace if grace is None else grace
        if grace > 0 and self._sock.poll(int(grace * 1000), zmq.POLLOUT):
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                pass
        log.debug("FFN peer %s not connected; message dropped", self.address)
        return False

    def _watch(self) -> None:
        while self._monitor.poll(0):
            event = self._monitor.recv_multipart()
            if zmq.utils.monitor.parse_monitor_message(event)["event"] == zmq.EVENT_DISCONNECTED:
                self._connection_lost(f"the connection to {self.address} closed")

    def _recv(self, timeout: float) -> FFNReply | None:
        ready = dict(self._poller.poll(max(0, int(timeout * 1000))))
        if ready.get(self._monitor):
            self._watch()
        if not ready.get(self._sock):
            return None
        frames = self._sock.recv_multipart(copy=False)
        try:
            reply = decode_reply([f.buffer for f in frames])
        except WireError as e:
            log.warning("malformed reply from %s ignored: %s", self.address, e)
            return None
        return stamp_received(reply)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


class ZmqListener(Listener):
    """A ROUTER socket served by one background thread that also runs the compute."""

    def __init__(self, address: str, serving: FFNServing, security: Security | None = None):
        self._serving = serving
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        _common_options(self._sock)
        # A peer that sends a frame no valid request has is disconnected by ZeroMQ itself, so
        # it cannot make this server buffer an arbitrary amount of memory.
        self._sock.setsockopt(zmq.MAXMSGSIZE, serving.limits.max_frame_bytes)
        self._auth = None
        if security is not None and security.curve:
            self._auth = _curve_server(self._ctx, self._sock, security)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            raise TransportError(f"cannot listen on {address}: {e}") from e
        # The bound address, with the port filled in when asked for port 0 / '*'.
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"ffn:{self.address}", daemon=True)
        self._thread.start()

    def _drain(self) -> list[Inbound[bytes]]:
        batch = []
        # EVENTS, not an exception from a non-blocking recv, says when the queue is empty.
        while len(batch) < _DRAIN and self._sock.get(zmq.EVENTS) & zmq.POLLIN:
            frames = self._sock.recv_multipart(copy=False)
            # ROUTER prefixes the sender's routing id; the rest is the message.
            batch.append(Inbound(frames[0].bytes, [f.buffer for f in frames[1:]], time.time()))
        return batch

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    if not poller.poll(_POLL_MS):
                        continue
                    for peer, frames in self._serving.serve_frames(self._drain()):
                        # ROUTER drops replies to peers that went away (not an error here).
                        self._sock.send_multipart([peer, *frames], copy=False)
                except Exception:  # never let one bad moment kill the server thread
                    log.exception("zmq listener %s: error in the serving loop", self.address)
        finally:
            self._sock.close(linger=0)  # sockets belong to the thread that uses them

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            log.error("zmq listener %s did not stop", self.address)
            return
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def connect(
    address: str, *, connect_grace: float = 0.5, security: Security | None = None, **_: object
) -> FFNClient:
    return ZmqClient(address, connect_grace=connect_grace, security=security)


def listen(
    address: str, serving: FFNServing, *, security: Security | None = None, **_: object
) -> Listener:
    return ZmqListener(address, serving, security)
