"""Load-based routing: least loaded first, own in-flight streams counted, dead servers skipped."""

import asyncio

import pytest

from afd.control import Health, Stats
from services.gateway.balancer import Balancer
from services.gateway.errors import APIError, unavailable


class Fake:
    def __init__(self, address, load=0, up=True, max_len=128):
        self.address, self.load, self.alive, self.max_len = address, load, up, max_len

    async def stats(self):
        if not self.alive:
            raise unavailable("down")
        return Stats(running=self.load, waiting=0, kv_usage=0.0)

    async def health(self):
        if not self.alive:
            raise unavailable("down")
        return Health(True, True, "", "m", self.max_len)

    async def close(self):
        pass


def test_least_loaded_wins_after_a_poll():
    a, b, c = Fake("a", 5), Fake("b", 1), Fake("c", 3)
    r = Balancer([a, b, c])
    asyncio.run(r.poll_once())
    assert r.pick() is b


def test_ties_rotate_and_own_streams_count():
    a, b = Fake("a"), Fake("b")
    r = Balancer([a, b])
    asyncio.run(r.poll_once())
    assert {r.pick(), r.pick()} == {a, b}  # round-robin among equals
    with r.lease(a), r.lease(a):
        assert all(r.pick() is b for _ in range(4))  # a has two streams open from us
    with r.lease(b):
        assert r.pick() is a


def test_dead_server_is_skipped_until_it_answers():
    a, b = Fake("a", 0), Fake("b", 9)
    r = Balancer([a, b])
    a.alive = False
    asyncio.run(r.poll_once())
    assert all(r.pick() is b for _ in range(3))
    b.alive = False
    asyncio.run(r.poll_once())
    with pytest.raises(APIError) as e:
        r.pick()
    assert e.value.status == 503
    a.alive = True
    asyncio.run(r.poll_once())
    assert r.pick() is a


def test_context_length_is_the_smallest_and_readiness_needs_one():
    a, b = Fake("a", max_len=128), Fake("b", max_len=64)
    r = Balancer([a, b], ready_cache_s=0)
    assert asyncio.run(r.max_model_len()) == 64
    assert asyncio.run(r.readiness()) == (True, [])
    b.alive = False
    ready, reasons = asyncio.run(r.readiness())
    assert ready and len(reasons) == 1 and reasons[0].startswith("b:")
    assert [s["state"] for s in r.servers()] == ["ready", "down"]
    a.alive = False
    ready, reasons = asyncio.run(r.readiness())
    assert not ready and [x[0] for x in reasons] == ["a", "b"]
