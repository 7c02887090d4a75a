"""Prefix caching: content hashes, the block manager's cache, and the scheduler reusing blocks.

The model here is fake but honest about what K/V is: each slot holds a value that depends on
its token *and every token before it* (as real keys and values do), and the next token is a
function of the values read back through the block table. A block reused for the wrong prefix,
a block overwritten while another request holds it, or a position skipped all change the
output, which is compared with a run without caching.
"""

from __future__ import annotations

import random

import pytest

from afd import prefix
from afd.config import SchedulerConfig
from afd.control import SamplingParams
from services.attention.block_manager import BlockManager
from services.attention.request import Request
from services.attention.scheduler import Scheduler, SchedulerOutput

BS = 4


def kv_value(seq: list[int]) -> int:
    h = 17
    for t in seq:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return h


class PrefixModel:
    """Writes kv_value(prefix up to the slot's position) into each computed slot."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], int] = {}
        self.computed = 0  # token positions computed, all requests together

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        for s in out.scheduled:
            seq = s.request.all_token_ids
            for j in range(s.num_new_tokens):
                p = s.start_pos + j
                self.kv[(s.block_ids[p // BS], p % BS)] = kv_value(seq[: p + 1])
            self.computed += s.num_new_tokens
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                end = s.start_pos + s.num_new_tokens
                vals = [self.kv[(s.block_ids[p // BS], p % BS)] for p in range(end)]
                sampled[s.request.request_id] = 10 + kv_value(vals) % 990
        return sampled


def make(num_blocks: int = 64, caching: bool = True, max_num_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs, 32, 128, True)
    return Scheduler(cfg, BlockManager(num_blocks, BS), 128, prefix_caching=caching)


def check_refs(s: Scheduler) -> None:
    """Every held block is held by as many running requests as its reference count says."""
    bm = s.block_manager
    holders: dict[int, int] = {}
    for r in s._running:
        assert len(set(r.block_ids)) == len(r.block_ids)
        for b in r.block_ids:
            holders[b] = holders.get(b, 0) + 1
    assert {b: n for b, n in enumerate(bm._refs) if n} == holders
    assert bm.num_used_blocks == len(holders)


def run(s: Scheduler, model: PrefixModel, arrivals: dict[int, list[Request]]) -> dict:
    """Step, adding `arrivals[step]` before each step, until all is done."""
    done: dict[str, Request] = {}
    for step in range(10_000):
        for r in arrivals.get(step, []):
            s.add_request(r)
        if not s.has_unfinished() and step > max(arrivals, default=0):
            bm = s.block_manager
            assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
            return done
        out = s.schedule()
        check_refs(s)
        for r in s.update(out, model.step(out)):
            if r.finished:
                done[r.request_id] = r
    raise AssertionError("no progress")


def req(rid: str, tokens: list[int], max_tokens: int = 6, **sp) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **sp))


def test_hash_chain_covers_the_whole_prefix() -> None:
    a = prefix.extend([], [1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = prefix.extend([], [9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different prefix: different hash
    # grown a block at a time, the chain is the same; partial blocks are never hashed
    grown: list[bytes] = []
    for n in range(1, 3):
        prefix.extend(grown, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, n)
    assert grown == a and prefix.extend(list(a), [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 5) == a
    # whatever else changes K/V (a cache salt) changes every block's hash
    assert prefix.extend([], [1, 2, 3, 4], 4, 1, extra=b"tenant")[0] != a[0]


def test_block_manager_caches_reuses_and_evicts_least_recently_freed() -> None:
    bm = BlockManager(4, BS)
    a = bm.allocate(2)  # 0 1
    bm.register(a[0], b"h0")
    bm.register(a[1], b"h1")
    bm.free(reversed(a))  # tail first: block 1 is evicted before block 0
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.lookup([b"h0", b"h1", b"h2"]) == [0, 1] and bm.lookup([b"h1"]) == [1]
    # never-cached blocks go first; then the least recently freed cached one (the tail)
    assert bm.allocate(2) == [2, 3]
    assert bm.allocate(1) == [1] and bm.num_evictions == 1
    assert bm.lookup([b"h0", b"h1"]) == [0]
    bm.touch([0])  # a hit takes it out of the free blocks
    assert bm.num_free_blocks == 0 and not bm.can_allocate(1)
    bm.touch([0])  # two holders
    bm.free([0])
    assert bm.num_free_blocks == 0  # one holder left
    with pytest.raises(ValueError, match="double free"):
        bm.free([0, 0])
    bm.free([0])
    with pytest.raises(ValueError, match="double free"):
        bm.free([0])
    with pytest.raises(ValueError, match="no cached prefix"):
        bm.touch([2])
    # a second block with an already cached content stays an ordinary block
    bm.register(2, b"h0")
    assert bm.lookup([b"h0"]) == [0]
    assert bm.reset_cache() == 1 and bm.lookup([b"h0"]) == []
    bm.free([1, 2, 3])
    assert bm.num_free_blocks == 4


def test_a_shared_prefix_is_computed_once_and_gives_the_same_tokens() -> None:
    system = [random.Random(1).randrange(100, 900) for _ in range(13)]
    prompts = [system + [20 + i, 30 + i, 40 + i] for i in range(4)]
    arrivals = {2 * i: [req(f"r{i}", p)] for i, p in enumerate(prompts)}
    base, cached = PrefixModel(), PrefixModel()
    want = run(
        make(caching=False),
        base,
        {k: [req(r.request_id, r.prompt_token_ids) for r in v] for k, v in arrivals.items()},
    )
    s = make()
    got = run(s, cached, arrivals)
    assert {k: r.output_token_ids for k, r in got.items()} == {
        k: r.output_token_ids for k, r in want.items()
    }
    # the first computes everything; the others find the system prompt's 3 full blocks
    assert got["r0"].num_cached_tokens == 0
    assert [got[f"r{i}"].num_cached_tokens for i in (1, 2, 3)] == [12, 12, 12]
    assert cached.computed == base.computed - 3 * 12
    assert (s.prefix_queries, s.prefix_hits) == (4 * 16, 36)


def test_a_prompt_found_whole_still_computes_its_last_token() -> None:
    prompt = list(range(100, 108))  # exactly two blocks
    s, m = make(), PrefixModel()
    first = run(s, m, {0: [req("a", prompt)]})
    again = run(s, m, {0: [req("b", prompt)]})
    # block 1 holds the last token, which is computed again, so only block 0 is reused
    assert again["b"].num_cached_tokens == 4
    assert again["b"].output_token_ids == first["a"].output_token_ids
    # a longer request continues where the first one's output left off: its decode blocks
    # were cached too
    longer = prompt + first["a"].output_token_ids[:5]
    third = run(s, m, {0: [req("c", longer)]})
    assert third["c"].num_cached_tokens == 12


def test_prompt_logprobs_requests_compute_their_prompt() -> None:
    prompt = list(range(200, 213))
    s, m = make(), PrefixModel()
    run(s, m, {0: [req("a", prompt)]})
    got = run(s, m, {0: [req("b", prompt, prompt_logprobs=0)]})
    assert got["b"].num_cached_tokens == 0


def test_without_caching_nothing_is_registered() -> None:
    s, m = make(caching=False), PrefixModel()
    prompt = list(range(300, 313))
    run(s, m, {0: [req("a", prompt)]})
    got = run(s, m, {0: [req("b", prompt)]})
    assert got["b"].num_cached_tokens == 0 and s.block_manager.num_cached_blocks == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_prefixes_under_memory_pressure_evict_and_preempt(seed: int) -> None:
    """Concurrent requests on a few shared prefixes in a pool far too small for them: cached
    blocks are evicted, running requests holding shared blocks are preempted, and every token
    is what an unconstrained run without caching gives."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 900) for _ in range(rng.randrange(5, 18))] for _ in range(3)]
    specs = []
    for i in range(24):
        p = rng.choice(systems) + [rng.randrange(100, 900) for _ in range(rng.randrange(1, 6))]
        specs.append((rng.randrange(0, 40), f"q{i}", p, rng.randrange(1, 14)))

    def arrivals() -> dict[int, list[Request]]:
        out: dict[int, list[Request]] = {}
        for t, rid, p, n in specs:
            out.setdefault(t, []).append(req(rid, p, n))
        return out

    want = run(make(num_blocks=512, caching=False), PrefixModel(), arrivals())
    s = make(num_blocks=12)
    got = run(s, PrefixModel(), arrivals())
    assert {k: r.output_token_ids for k, r in got.items()} == {
        k: r.output_token_ids for k, r in want.items()
    }
    assert s.num_preemptions > 0 and s.block_manager.num_evictions > 0
    assert s.prefix_hits > 0


def test_a_request_preempted_while_sharing_blocks_leaves_them_to_the_other() -> None:
    """B shares A's two prompt blocks; as both decode the pool runs out and B (admitted last)
    is preempted while it holds blocks A holds too: they stay with A, B recomputes later from
    what is still cached, and both get the tokens of a run without caching or pressure."""
    prompt = list(range(400, 408))  # two full blocks
    specs = {0: [("a", prompt, 12)], 1: [("b", prompt + [9], 12)]}

    def arrivals():
        return {t: [req(rid, p, n) for rid, p, n in v] for t, v in specs.items()}

    s = make(num_blocks=7)
    shared_at_preemption: list[list[int]] = []
    preempt = s._preempt

    def watching(victim):
        shared_at_preemption.append([s.block_manager._refs[b] for b in victim.block_ids])
        preempt(victim)

    s._preempt = watching
    got = run(s, PrefixModel(), arrivals())
    want = run(make(num_blocks=512, caching=False), PrefixModel(), arrivals())
    assert {k: r.output_token_ids for k, r in got.items()} == {
        k: r.output_token_ids for k, r in want.items()
    }
    assert got["b"].num_preemptions >= 1 and got["b"].num_cached_tokens == 8
    assert any(refs[:2] == [2, 2] for refs in shared_at_preemption)


def test_requests_with_different_cache_salts_share_no_blocks() -> None:
    """vLLM's cache_salt: the salt is in every block's hash, so a tenant's cached prompt is
    found only by requests carrying the same salt."""
    prompt = list(range(500, 513))
    s, m = make(), PrefixModel()
    run(s, m, {0: [req("a", prompt, cache_salt="tenant-a")]})
    got = run(s, m, {0: [req("b", prompt, cache_salt="tenant-b"), req("plain", prompt)]})
    assert got["b"].num_cached_tokens == 0 and got["plain"].num_cached_tokens == 0
    again = run(s, m, {0: [req("a2", prompt, cache_salt="tenant-a")]})
    assert again["a2"].num_cached_tokens == 12
