"""Every transport backend, with the FFN side in a separate process where the backend allows.

The server process runs a deterministic handler (output = dequantized hidden * (layer + 1),
in bf16), so every reply can be checked exactly. inproc is by definition one process: it runs
the same checks with an in-process listener.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from afd.errors import TransportError
from afd.messages import FFNReply, FFNRequest
from afd.quant import dequantize_fp8, quantize_fp8
from afd.transport import FFNServing, connect, listen
from afd.wire import WireLimits, encode_request

REPO = Path(__file__).resolve().parents[2]
LIMITS = WireLimits(hidden_size=64, num_layers=4, num_experts=8, max_tokens=64, top_k=2)
SLOW_LAYER = 3  # the handler sleeps on this layer, so that messages pile up behind it
SLOW_S = 0.3
TIMEOUT = 5.0
pytestmark = pytest.mark.timeout(60)

SERVER = f"""
import sys, time, torch
from afd.quant import dequantize_fp8
from afd.transport import FFNServing, listen
from afd.wire import WireLimits

def compute(layer, reqs):
    assert all(r.layer == layer for r in reqs), "one compute call per layer"
    if layer == {SLOW_LAYER}:
        time.sleep({SLOW_S})
    out = []
    for r in reqs:
        fp8 = r.scales is not None
        h = dequantize_fp8(r.hidden, r.scales, torch.float32) if fp8 else r.hidden.float()
        out.append((h * (layer + 1)).bfloat16())
    return out

limits = WireLimits(*{tuple(vars(LIMITS).values())})
listener = listen(sys.argv[1], FFNServing(compute, limits))
print("READY", listener.address, flush=True)
sys.stdin.read()  # serve until the parent closes our stdin (or kills us)
listener.close()
"""


def _compute(layer: int, reqs: list[FFNRequest]) -> list[torch.Tensor]:  # the same, for inproc
    return [_expected(r) for r in reqs]


class Server:
    """The FFN side: a child process for network schemes, a listener in this one for inproc."""

    def __init__(self, address: str):
        self.requested = address
        self.proc: subprocess.Popen | None = None
        self.listener = None
        self.address = self.start(address)

    def start(self, address: str) -> str:
        if address.startswith("inproc://"):
            self.listener = listen(address, FFNServing(_compute, LIMITS))
            return address
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            self.kill()
            raise RuntimeError(f"FFN server on {address} did not start: {line!r}")
        return line.split()[1]

    def kill(self) -> None:
        """A crash: SIGKILL, no goodbye."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def _address(scheme: str, tmp: Path) -> str:
    return {
        "tcp": "tcp://127.0.0.1:0",
        "ipc": f"ipc://{tmp / 'ffn.sock'}",
        "grpc": "grpc://127.0.0.1:0",
        "inproc": f"inproc://ffn-{tmp.name}",
    }[scheme]


SCHEMES = ["tcp", "ipc", "grpc", "inproc"]


@pytest.fixture(scope="module", params=SCHEMES)
def server(request, tmp_path_factory):
    srv = Server(_address(request.param, tmp_path_factory.mktemp(request.param)))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = connect(server.address)
    yield c
    c.close()


def _request(seq: int, layer: int, mb: int = 0, fp8: bool = True, t: int = 6) -> FFNRequest:
    g = torch.Generator().manual_seed(seq)
    x = torch.randn(t, LIMITS.hidden_size, generator=g)  # [T, H]
    hidden, scales = quantize_fp8(x) if fp8 else (x.bfloat16(), None)
    return FFNRequest(
        layer=layer,
        micro_batch=mb,
        seq=seq,
        hidden=hidden,
        scales=scales,
        expert_ids=torch.randint(0, LIMITS.num_experts, (t, LIMITS.top_k), generator=g),
        expert_weights=torch.rand(t, LIMITS.top_k, generator=g),
        sender="test",
        deadline=time.time() + TIMEOUT,
        t_send=time.time(),
    )


def _expected(r: FFNRequest) -> torch.Tensor:
    h = r.hidden.float() if r.scales is None else dequantize_fp8(r.hidden, r.scales, torch.float32)
    return (h * (r.layer + 1)).bfloat16()  # [T, H]


def _check(reply: FFNReply, req: FFNRequest) -> None:
    assert reply.ok, reply.error
    assert (reply.seq, reply.layer, reply.micro_batch) == (req.seq, req.layer, req.micro_batch)
    assert torch.equal(reply.output, _expected(req))


def test_round_trips_with_micro_batches_in_flight(client):
    seq = 1000
    for step in range(10):
        for layer in range(LIMITS.num_layers - 1):  # the slow layer has its own test
            reqs = [_request(seq + mb, layer, mb, fp8=(step + mb) % 2 == 0) for mb in range(3)]
            seq += 3
            for r in reqs:
                client.send(r)
            for r in reversed(reqs):  # out of order: replies are matched by seq
                reply = client.wait(r.seq, TIMEOUT)
                _check(reply, r)
                # stamped by the one serving loop, whichever the transport
                assert reply.trace.a_send == r.t_send
                assert r.t_send <= reply.trace.a_recv and reply.trace.f_send > 0


def test_same_layer_messages_are_computed_together(client):
    slow = _request(1, SLOW_LAYER)
    client.send(slow)
    time.sleep(SLOW_S / 5)  # while the server sleeps on the slow layer, three more arrive
    reqs = [_request(2 + mb, 0, mb) for mb in range(3)]
    for r in reqs:
        client.send(r)
    _check(client.wait(slow.seq, TIMEOUT), slow)
    replies = [client.wait(r.seq, TIMEOUT) for r in reqs]
    for reply, r in zip(replies, reqs, strict=True):
        _check(reply, r)
    assert [rep.trace.merged for rep in replies] == [3, 3, 3]


@pytest.mark.parametrize("scheme", ["tcp", "ipc", "grpc"])
def test_malformed_messages_beside_valid_traffic(scheme, tmp_path):
    srv = Server(_address(scheme, tmp_path))
    client = connect(srv.address)
    try:
        good = _request(1, 0)
        client.send(good)
        _check(client.wait(1, TIMEOUT), good)

        frames = [bytes(f) for f in encode_request(_request(2, 1))]
        truncated = [*frames[:1], frames[1][:-1], *frames[2:]]
        ids = torch.full((6, LIMITS.top_k), LIMITS.num_experts, dtype=torch.int32)
        bad_ids = [bytes(f) for f in encode_request(_request(3, 1))]
        bad_ids[3] = ids.numpy().tobytes()
        bad_layer = [bytes(f) for f in encode_request(_request(4, LIMITS.num_layers - 1))]
        from afd.v1 import ffn_pb2  # tests may look inside; the product goes through afd.wire

        header = ffn_pb2.FFNRequestHeader.FromString(bad_layer[0])
        header.layer = 99
        bad_layer[0] = header.SerializeToString()
        header.layer, header.version, header.seq = 1, 7, 5
        bad_version = [header.SerializeToString(), *bad_layer[1:]]

        valid = [_request(10 + i, i % 3) for i in range(6)]
        client.send_frames([b"\xde\xad\xbe\xef garbage"])  # unreadable: dropped
        client.send(valid[0])
        client.send_frames(truncated)
        client.send(valid[1])
        client.send_frames(bad_ids)
        client.send_frames([b""])  # an empty header: dropped
        client.send(valid[2])
        client.send_frames(bad_layer)
        client.send_frames(bad_version)
        for r in valid[3:]:
            client.send(r)

        for r in valid:
            _check(client.wait(r.seq, TIMEOUT), r)
        codes = {seq: client.wait(seq, TIMEOUT).error_code for seq in (2, 3, 4)}
        assert codes == {2: "bad_size", 3: "bad_value", 4: "bad_value"}
        assert client.wait(5, TIMEOUT).error_code == "bad_version"
        # Nothing else came back: the garbage was dropped, and the server still serves.
        client.send(good := _request(20, 2))
        _check(client.wait(20, TIMEOUT), good)
        assert not client._early
    finally:
        client.close()
        srv.stop()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_peer_crash_times_out_then_restart_recovers(scheme, tmp_path):
    srv = Server(_address(scheme, tmp_path))
    client = connect(srv.address)
    try:
        r = _request(1, 0)
        client.send(r)
        _check(client.wait(1, TIMEOUT), r)

        srv.kill()
        timeout = 0.5
        for seq in (2, 3):  # right after the crash, and once the client has noticed it
            client.send(_request(seq, 0))
            start = time.monotonic()
            with pytest.raises(TransportError):
                client.wait(seq, timeout)
            assert time.monotonic() - start < timeout + 1.0  # no hang

        srv.address = srv.start(srv.address)  # same address as before
        client.reset()
        deadline, seq = time.monotonic() + 15, 100
        while True:  # the reconnect takes a moment; the same client must get there
            seq += 1
            r = _request(seq, 1)
            client.send(r)
            try:
                _check(client.wait(seq, 1.0), r)
                break
            except TransportError:
                assert time.monotonic() < deadline, "client never reconnected"
        for seq in range(200, 205):  # and then it stays healthy
            r = _request(seq, 2, fp8=False)
            client.send(r)
            _check(client.wait(seq, TIMEOUT), r)
    finally:
        client.close()
        srv.stop()


@pytest.mark.parametrize("scheme", ["tcp", "ipc", "grpc"])
def test_listener_close_stops_its_threads(scheme, tmp_path):
    import threading

    before = set(threading.enumerate())
    listener = listen(_address(scheme, tmp_path), FFNServing(_compute, LIMITS))
    client = connect(listener.address)
    r = _request(1, 0)
    client.send(r)
    _check(client.wait(1, TIMEOUT), r)
    start = time.monotonic()
    client.close()
    listener.close()
    assert time.monotonic() - start < 3
    time.sleep(0.2)
    leftover = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not [t for t in leftover if t.name.startswith(("ffn:", "grpc-reader"))], leftover


@pytest.mark.parametrize("scheme", ["inproc", "tcp"])
def test_every_transport_serves_through_the_same_checks(scheme, tmp_path):
    """Validation, deadlines, draining and metrics are the serving loop's, so the in-process
    path answers exactly as a network one: a typed error reply each, never a compute."""
    from afd import metrics

    computed = []

    def compute(layer, reqs):
        computed.extend(r.seq for r in reqs)
        return [_expected(r) for r in reqs]

    serving = FFNServing(compute, LIMITS)
    listener = listen(_address(scheme, tmp_path), serving)
    client = connect(listener.address)
    try:
        bad_id = _request(1, 0)
        bad_id.expert_ids[0, 0] = LIMITS.num_experts  # one past the last expert
        late = replace(_request(2, 0), deadline=time.time() - 1)
        served_before = metrics.FFN_MESSAGES._value.get()
        ok = _request(3, 0)
        for r in (bad_id, late, ok):
            client.send(r)
        assert client.wait(1, TIMEOUT).error_code == "bad_value"
        assert client.wait(2, TIMEOUT).error_code == "deadline_exceeded"
        _check(client.wait(3, TIMEOUT), ok)
        assert metrics.FFN_MESSAGES._value.get() == served_before + 1
        serving.draining = True
        client.send(_request(4, 0))
        reply = client.wait(4, TIMEOUT)
        assert reply.error_code == "unavailable" and "draining" in reply.error
        assert computed == [3]
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
def test_an_oversized_zeromq_frame_is_dropped_by_the_socket(scheme, tmp_path):
    """A frame larger than any valid request's is refused by ZeroMQ itself (MAXMSGSIZE: the
    peer is disconnected before the frame is buffered); the listener keeps serving, and the
    client's reconnection carries on."""
    computed = []

    def compute(layer, reqs):
        computed.extend(r.seq for r in reqs)
        return [_expected(r) for r in reqs]

    listener = listen(_address(scheme, tmp_path), FFNServing(compute, LIMITS))
    client = connect(listener.address)
    try:
        huge = bytes(LIMITS.max_frame_bytes + 1)
        header = bytes(encode_request(_request(1, 0))[0])
        client.send_frames([header, huge, b"", b"", b""])
        deadline = time.monotonic() + TIMEOUT
        while True:  # reconnected after the drop: a valid request is answered again
            ok = _request(2, 0)
            client.send(replace(ok, deadline=time.time() + 1))
            try:
                _check(client.wait(2, 1.5), ok)
                break
            except TransportError:
                client.reset(below=0)
                assert time.monotonic() < deadline, "the listener stopped serving"
        assert 1 not in computed
        assert client.poll(1, 0.5) is None  # no reply at all: the socket dropped it unread
    finally:
        client.close()
        listener.close()
