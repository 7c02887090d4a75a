"""An elastic FFN pool in process: members join and leave between steps while requests run,
placement follows (and replicates hot experts), and the tokens stay transformers' own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from afd.control import SamplingParams
from afd_cli.local import serve_ffn_inproc
from services.attention.engine import Engine
from services.attention.pool_source import write_pool
from tests.helpers.checkpoints import REFERENCE_CHECKPOINTS, hf_greedy, hf_model
from tests.integration.test_engine_reference import engine_cfg

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 57)), [7, 7, 7], list(range(100, 119))]
NEW = 16
# step -> the pool file's members from then on (indices into the three servers)
CHANGES = {0: [0], 3: [0, 1], 7: [0, 1, 2], 11: [1, 2], 14: [2]}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def family(request, tmp_path_factory):
    """deepseek_v3: a shared expert and a dense first layer (one member computes them)."""
    path = REFERENCE_CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt")
    return path, hf_greedy(hf_model(path, torch.float32), PROMPTS, NEW)


def run_elastic(path, tmp_path, hot: int):
    names = [f"inproc://elastic-{tmp_path.name}-{hot}-{i}" for i in range(3)]
    base = engine_cfg(path, S=2)
    # three servers that each hold every expert (one shard, three replicas of it)
    listeners = serve_ffn_inproc(replace(base, ffn_addresses=("|".join(names),)), progress=False)
    pool = tmp_path / f"pool-{hot}"
    write_pool(pool, [names[0]])
    cfg = replace(base, ffn_pool=f"file:{pool}", ffn_pool_interval_s=1e-3, hot_expert_replicas=hot)
    answered: list[set[str]] = []
    try:
        eng = Engine(cfg, progress=False)
        sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        reqs = [eng.add_request(p, sp) for p in PROMPTS]
        step = 0
        while eng.has_unfinished():
            if step in CHANGES:
                write_pool(pool, [names[i] for i in CHANGES[step]])
            result = eng.step()  # paused (nothing computed) until a joining member answers
            if not result.paused:
                answered.append({addr for addr, _ in result.timing.traces})
                step += 1
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        return [r.output_token_ids for r in reqs], answered, eng, names
    finally:
        for lst in listeners:
            lst.close()


@pytest.mark.parametrize("hot", [0, 2])
def test_members_join_and_leave_while_requests_run(family, tmp_path, hot):
    path, ref = family
    tokens, answered, eng, names = run_elastic(path, tmp_path, hot)
    assert tokens == ref
    everyone = set().union(*answered)
    assert everyone == set(names)  # each member computed while it was in the pool
    # the first member, gone since step 11, got nothing after its removal took effect
    assert all(names[0] not in a for a in answered[12:])
    assert eng.pool.changes >= 4
    load = eng.dispatcher.expert_load
    assert int(load.sum()) > 0  # tokens per expert per layer were counted


def test_placement_splits_the_hottest_experts_between_two_members():
    from services.attention.placement import Placement

    load = torch.tensor([[100, 10, 10, 10, 10, 10, 10, 40]])  # one layer, 8 experts
    p = Placement.compute(3, 1, 8, load, hot=1)
    first, second = p.table[0, 0].tolist()
    assert first != second  # expert 0 on two members
    ids = torch.zeros(6, 1, dtype=torch.int32)  # six tokens, all on expert 0
    members = p.assign(0, ids).view(-1).tolist()
    assert members.count(first) == members.count(second) == 3
    # without load: contiguous ranges, every expert on one member
    flat = Placement.compute(3, 1, 8)
    assert flat.table[0, :, 0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert torch.equal(flat.table[0, :, 0], flat.table[0, :, 1])
