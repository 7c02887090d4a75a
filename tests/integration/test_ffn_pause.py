"""An expert shard that loses its last FFN replica pauses the engine (an in-process cluster of two
shards, the tiny model, shard 1's client cut off by the test as a dead peer looks): requests keep
their KV blocks and their place, the step in flight is run again once the shard is back, and the
greedy tokens are those of an undisturbed run; past the grace period the requests fail with a
typed error and free their blocks; with no grace they fail at once."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace

import pytest

from afd.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from afd.control import SamplingParams
from afd.demo import TINY_CONFIG, write_step3_checkpoint
from afd.errors import ErrorCode
from afd_cli.local import local_engine

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 37)), [7, 7, 7]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> EngineConfig:
    path = write_step3_checkpoint(
        tmp_path_factory.mktemp("pause") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )
    return EngineConfig(
        model=ModelConfig.from_hf(path),
        dtype="float32",
        a2f_dtype="fp32",
        micro_batches=2,
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),  # chunked prefill
    )


@contextmanager
def cut(client, after: int = 0):
    """`client` as a dead peer looks: after `after` more messages, every send and every probe
    is refused."""
    sent = [0]
    send = client.send

    def refuse(req):
        sent[0] += 1
        return send(req) if sent[0] <= after else False

    client.send, client.try_send = refuse, lambda req: False
    try:
        yield
    finally:
        del client.send, client.try_send  # the class's methods again


def _state(reqs):
    """What a step advances: K/V computed, tokens out."""
    return [(r.num_computed_tokens, list(r.output_token_ids)) for r in reqs]


@pytest.mark.parametrize(
    "spec",
    [None, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)],
    ids=["plain", "drafting"],
)
def test_a_shard_lost_mid_step_pauses_and_resumes_with_the_same_tokens(cfg, spec):
    """(drafting: the lost step may be a verify step; its drafts are planned again too)"""
    with local_engine(replace(cfg, speculative=spec), 2, progress=False) as eng:
        want = [r.output_token_ids for r in eng.generate(PROMPTS, GREEDY)]
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
        for _ in range(3):  # prefill chunks and a first decode
            eng.step()
        before, blocks = _state(reqs), [list(r.block_ids) for r in reqs]
        assert all(n for n, _ in before)
        with cut(eng.replicas.shards[1][0].client, after=1):  # its 2nd message: mid-step
            first = eng.step()
            assert first.paused and not first.requests
            assert eng.replicas.uncovered() == [1] and eng.paused
            for _ in range(5):
                assert eng.step().paused
            assert _state(reqs) == before  # nothing advanced ...
            # ... nor freed (the lost step's new blocks are kept for its second run)
            assert all(r.block_ids[: len(b)] == b for r, b in zip(reqs, blocks, strict=True))
            eng.abort(reqs[2].request_id)  # a client leaving during the pause frees its blocks
            assert not reqs[2].block_ids
        drafted = 0
        while eng.has_unfinished():  # probed back, then the lost step is planned again
            drafted += eng.step().drafts[1]
        assert not eng.paused
        assert (drafted > 0) == (spec is not None)
        assert [r.output_token_ids for r in reqs[:2]] == want[:2]
        assert all(r.finish_reason == "length" for r in reqs[:2])
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_past_the_grace_period_requests_fail_typed_and_free_their_blocks(cfg):
    with local_engine(replace(cfg, ffn_grace_s=0.3), 2, progress=False) as eng:
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
        eng.step()
        t0 = time.monotonic()
        with cut(eng.replicas.shards[1][0].client):
            failed = []
            while not failed:
                result = eng.step()
                failed = result.requests
                assert result.paused or failed
        assert time.monotonic() - t0 >= 0.3
        assert sorted(r.request_id for r in failed) == sorted(r.request_id for r in reqs)
        assert all(
            r.finish_reason == "error" and r.error_code == ErrorCode.UNAVAILABLE for r in reqs
        )
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        while eng.replicas.uncovered():  # probed back
            eng.maintain_ffn()
            time.sleep(0.01)
        late = eng.add_request(PROMPTS[0], GREEDY)
        while eng.has_unfinished():
            eng.step()
        assert late.finish_reason == "length"


def test_with_no_grace_a_lost_shard_fails_the_step_at_once(cfg):
    with local_engine(replace(cfg, ffn_grace_s=0.0), 2, progress=False) as eng:
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
        with cut(eng.replicas.shards[1][0].client):
            result = eng.step()
        assert not result.paused and result.requests  # the step's requests, failed
        assert all(r.finish_reason == "error" for r in result.requests)
        assert all(not r.block_ids for r in reqs)
