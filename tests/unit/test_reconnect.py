"""Every gRPC channel afd opens reconnects within a second of a peer's return: gRPC's own
backoff grows from 1 s towards 2 minutes while the peer is down, so a gateway whose attention
server came back after a long outage saw it up to that much later (measured with its channel:
4.8 s after a 20 s outage, against 0.5 s with afd's options)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from afd.security import RECONNECT_OPTIONS, aio_channel, channel
from services.gateway.client import AttentionClient


class _HangUp:
    """A listener that closes every connection it accepts: each is one reconnection attempt of
    a channel pointed at it, which fails and backs off."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_the_gateways_client_keeps_trying_a_down_server_every_second():
    """Polled every 0.2 s for 4 s, the gateway's channel to a server that hangs up tries again
    and again: gRPC's backoff alone (1, 1.6, 2.6 s ...) allows at most 4 attempts in that time;
    afd's (0.1 s growing to 1 s) makes about 8."""
    down = _HangUp()

    async def poll() -> None:
        client = AttentionClient(down.address, rpc_timeout_s=0.5)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.0:
            with pytest.raises(Exception):  # noqa: B017 - any failure: nothing answers
                await client.stats()
            await asyncio.sleep(0.2)
        await client.close()

    try:
        asyncio.run(poll())
    finally:
        down.close()
    assert down.accepted >= 6, down.accepted


def test_every_channel_gets_the_reconnect_options_unless_the_caller_sets_them(monkeypatch):
    import grpc

    seen = []
    monkeypatch.setattr(grpc, "insecure_channel", lambda t, options: seen.append(dict(options)))
    monkeypatch.setattr(grpc.aio, "insecure_channel", lambda t, options: seen.append(dict(options)))
    channel("127.0.0.1:1", [("grpc.max_reconnect_backoff_ms", 5000)], None)
    aio_channel("127.0.0.1:1", [("grpc.keepalive_time_ms", 1)], None)
    assert seen[0] == {**dict(RECONNECT_OPTIONS), "grpc.max_reconnect_backoff_ms": 5000}
    assert seen[1] == {**dict(RECONNECT_OPTIONS), "grpc.keepalive_time_ms": 1}
