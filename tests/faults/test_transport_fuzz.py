"""A live FFN listener (a separate process) fed hundreds of randomly mutated and random frames
interleaved with valid requests keeps answering every valid one correctly (tcp and grpc)."""

from __future__ import annotations

import random

import pytest

from afd.wire import encode_request
from tests.integration.test_transports import TIMEOUT, Server, _address, _check, _request
from tests.unit.test_wire import _mutate

FRAMES = 600  # hostile messages per backend in the default suite
FRAMES_SLOW = 10_000  # ... and in the slow set
VALID_SEQ = 10**9  # far from any seq a mutation can produce from the templates (< 100)


@pytest.mark.parametrize(
    "hostile",
    [
        pytest.param(FRAMES, id="ci", marks=pytest.mark.timeout(60)),
        pytest.param(FRAMES_SLOW, id="slow", marks=[pytest.mark.slow, pytest.mark.timeout(900)]),
    ],
)
@pytest.mark.parametrize("scheme", ["tcp", "grpc"])
def test_mutated_frames_beside_valid_traffic_keep_it_served(scheme, tmp_path, hostile):
    from afd.transport import connect

    srv = Server(_address(scheme, tmp_path))
    client = connect(srv.address)
    rng = random.Random(6)
    templates = [
        [bytes(f) for f in encode_request(_request(s, s % 3, fp8=s % 2 == 0))] for s in range(8)
    ]
    try:
        served = 0
        for i in range(hostile):
            if rng.random() < 0.2:
                frames = [rng.randbytes(rng.randint(0, 48)) for _ in range(rng.randint(1, 6))]
            else:
                frames = _mutate(templates[i % len(templates)], rng)
            client.send_frames(frames)
            if i % 50 == 49:  # valid traffic in between
                req = _request(VALID_SEQ + i, i % 3)
                client.send(req)
                _check(client.wait(req.seq, TIMEOUT), req)
                served += 1
        assert served == hostile // 50
        print(f"\ntransport fuzz {scheme}: {hostile} hostile messages, {served} valid ones served")
    finally:
        client.close()
        srv.stop()
