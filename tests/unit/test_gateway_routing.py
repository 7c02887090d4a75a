"""Prefix-aware routing: the key, the consistent-hash ring, the load guard, the policies."""

from __future__ import annotations

import asyncio
import random

import pytest

from afd import metrics
from afd.control import Stats
from afd.errors import ConfigError
from services.gateway.balancer import Balancer
from services.gateway.routing import BLOCK, Ring, RoutingConfig, routing_key
from tests.unit.test_gateway_balancer import Fake


def prompts(n: int, shared: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [shared + [rng.randrange(1000) for _ in range(20)] for _ in range(n)]


def test_the_key_is_the_prompts_start_in_whole_blocks() -> None:
    base = list(range(300))
    assert routing_key(base, 256) == routing_key(base[:256] + [7] * 50, 256)  # after the key
    assert routing_key(base, 256) != routing_key([9] + base[1:], 256)  # in its first block
    # a prompt shorter than the key: its whole blocks (the partial last block is left out)
    assert routing_key(base[:40], 256) == routing_key(base[:32] + [1, 2, 3], 256)
    assert routing_key(base[:40], 256) != routing_key(base[:16] + [5] * 24, 256)
    # below one block: the whole prompt
    assert routing_key([1, 2], 256) != routing_key([1, 3], 256)
    assert len(routing_key(base, 256)) == 16 and BLOCK == 16


def test_the_ring_spreads_keys_and_a_new_server_takes_only_its_share() -> None:
    keys = [routing_key([i, i + 1, i + 2], 256) for i in range(3000)]
    two, three = Ring(["a:1", "b:1"]), Ring(["a:1", "b:1", "c:1"])
    owners2 = [two.order(k)[0] for k in keys]
    owners3 = [three.order(k)[0] for k in keys]
    share = owners2.count(0) / len(keys)
    assert 0.35 < share < 0.65
    moved = [(x, y) for x, y in zip(owners2, owners3, strict=True) if x != y]
    # the keys that moved all went to the new server, about a third of them
    assert all(y == 2 for _, y in moved) and 0.2 < len(moved) / len(keys) < 0.45
    # the order lists every server once: who takes over when the owner is skipped
    assert sorted(three.order(keys[0])) == [0, 1, 2]


def test_config_validates_itself() -> None:
    with pytest.raises(ConfigError, match="routing policy"):
        RoutingConfig(policy="random")
    with pytest.raises(ConfigError, match="prefix tokens"):
        RoutingConfig(prefix_tokens=0)
    with pytest.raises(ConfigError, match="balance_ratio"):
        RoutingConfig(balance_ratio=0.5)


def balancer(n: int, **routing) -> tuple[Balancer, list[Fake]]:
    fakes = [Fake(f"s{i}:1") for i in range(n)]
    b = Balancer(fakes, routing=RoutingConfig(**routing))
    asyncio.run(b.poll_once())
    return b, fakes


def test_prompts_sharing_a_prefix_meet_on_one_server_and_others_spread() -> None:
    b, fakes = balancer(3)
    system = list(range(500, 800))
    chosen = {b.pick(prompt=p).address for p in prompts(30, system)}
    assert len(chosen) == 1
    # distinct prompts land all over the pool
    spread = {b.pick(prompt=[i] * 40).address for i in range(60)}
    assert spread == {f.address for f in fakes}


def test_an_overloaded_owner_sends_the_request_to_the_idlest() -> None:
    b, fakes = balancer(2, balance_abs=4, balance_ratio=1.5)
    p = prompts(1, list(range(300)))[0]
    owner = b.pick(prompt=p)
    other = next(f for f in fakes if f is not owner)
    before = metrics.ROUTED.labels(other.address, "balance")._value.get()
    owner.load, other.load = 4, 0  # 4 more: within the guard
    asyncio.run(b.poll_once())
    assert b.pick(prompt=p) is owner
    owner.load = 5  # 5 more than an idle server: over both bounds
    asyncio.run(b.poll_once())
    assert b.pick(prompt=p) is other
    assert metrics.ROUTED.labels(other.address, "balance")._value.get() == before + 1
    other.load = 3  # 5 against 3: within the ratio
    asyncio.run(b.poll_once())
    assert b.pick(prompt=p) is owner


def test_a_down_owner_passes_its_keys_to_the_next_server_on_the_ring() -> None:
    b, fakes = balancer(3)
    p = prompts(1, list(range(300)))[0]
    owner = b.pick(prompt=p)
    owner.alive = False
    asyncio.run(b.poll_once())
    second = b.pick(prompt=p)
    assert second is not owner and all(b.pick(prompt=p) is second for _ in range(5))
    # excluded (a retry after it failed the request): the same rule
    assert b.pick(exclude=(second,), prompt=p) not in (owner, second)


def test_round_robin_and_least_loaded_policies() -> None:
    b, fakes = balancer(2, policy="round-robin")
    p = list(range(100))
    assert {b.pick(prompt=p).address for _ in range(2)} == {f.address for f in fakes}
    b, fakes = balancer(2, policy="least-loaded")
    fakes[0].load = 3
    asyncio.run(b.poll_once())
    assert all(b.pick(prompt=p) is fakes[1] for _ in range(4))


def test_each_servers_hit_rate_is_polled_into_the_gateway_metrics() -> None:
    class Caching(Fake):
        async def stats(self):
            return Stats(0, 0, 0.0, prefix_queries=400, prefix_hits=300)

    b = Balancer([Caching("hits:1"), Fake("cold:1")])
    asyncio.run(b.poll_once())
    rates = {s["address"]: s["prefix_cache_hit_rate"] for s in b.servers()}
    assert rates == {"hits:1": 0.75, "cold:1": 0.0}
    assert metrics.SERVER_PREFIX_HIT_RATE.labels("hits:1")._value.get() == 0.75
