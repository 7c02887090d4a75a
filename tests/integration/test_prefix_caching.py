"""Prefix caching end to end: prompts that share prefixes, served by an engine whose cache
supplies the shared blocks, give exactly the reference's greedy tokens (float32, fp32 wire),
for every family (GQA, MFA, MLA, DSA's indexer keys, sinks and sliding windows), with
micro-batches, chunked prefill, preemption and eviction; and no block leaks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from afd.config import CacheConfig
from afd.control import SamplingParams
from afd_cli.local import local_engine
from tests.helpers.checkpoints import (
    DENSE_REFERENCES,
    REFERENCE_CHECKPOINTS,
    hf_greedy,
    hf_model,
)
from tests.integration.test_engine_reference import engine_cfg

SYSTEM = [(37 * i + 11) % 240 + 5 for i in range(23)]  # 5 full blocks of 4, and 3 tokens
PROMPTS = [
    SYSTEM + [251, 252],  # computed first, alone: every later prompt can find its blocks
    SYSTEM + [253, 254, 255, 250, 249],
    SYSTEM[:20],  # the whole prompt is cached: its last token is computed again
    SYSTEM[:14] + [248, 247, 246],  # leaves the shared prefix inside a block
    SYSTEM + [251, 252, 7, 8, 9],  # the first prompt's blocks, then new ones
    [3, 1, 4, 1, 5, 9, 2, 6],  # shares nothing
    SYSTEM[4:8] * 2 + [250],  # a cached block's tokens, at another position: no hit
]
NEW = 10


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """model_type -> (checkpoint, reference greedy tokens of PROMPTS)."""
    out = {}
    for model_type, write in REFERENCE_CHECKPOINTS.items():
        path = write(tmp_path_factory.mktemp(model_type) / "ckpt")
        if model_type in DENSE_REFERENCES:
            out[model_type] = (path, DENSE_REFERENCES[model_type](path, PROMPTS, NEW))
        else:
            out[model_type] = (path, hf_greedy(hf_model(path, torch.float32), PROMPTS, NEW))
    return out


def cached_greedy(cfg):
    """PROMPTS[0] alone to the end, then the rest at once; (tokens, cached tokens, preemptions,
    evictions)."""
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    with local_engine(cfg, 1, progress=False) as eng:
        first = eng.generate(PROMPTS[:1], sp)
        rest = eng.generate(PROMPTS[1:], sp)
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks, "KV blocks leaked"
        reqs = first + rest
        return (
            [r.output_token_ids for r in reqs],
            [r.num_cached_tokens for r in reqs],
            eng.scheduler.num_preemptions,
            eng.blocks.num_evictions,
        )


@pytest.mark.parametrize("family", sorted(REFERENCE_CHECKPOINTS))
@pytest.mark.parametrize("S", [1, 2])
def test_cached_prefixes_give_the_reference_tokens(refs, family, S):
    path, ref = refs[family]
    got, cached, _, _ = cached_greedy(engine_cfg(path, S=S))
    assert got == ref
    # what each prompt found: nothing (first), the system prompt's 5 full blocks, 4 of the 5
    # blocks of a prompt that is all cached (its last block holds the token computed again),
    # 3 blocks, the first prompt's 6 blocks (its sixth block filled as it decoded), nothing
    assert cached == [0, 20, 16, 12, 24, 0, 0]


@pytest.mark.parametrize("family", sorted(REFERENCE_CHECKPOINTS))
def test_under_memory_pressure_shared_blocks_are_evicted_and_preempted(refs, family):
    path, ref = refs[family]
    # 14 blocks of 4 cannot hold the five concurrent sequences: cached blocks are reused and
    # requests holding shared blocks are preempted; a budget of 8 tokens chunks every prefill
    cfg = engine_cfg(path, S=2, blocks=14, budget=8)
    got, cached, preemptions, evictions = cached_greedy(cfg)
    assert got == ref
    assert preemptions > 0 and evictions > 0 and sum(cached) > 0


def test_caching_off_computes_everything(refs):
    path, ref = refs["qwen3_moe"]
    cfg = engine_cfg(path)
    cfg = replace(cfg, cache=CacheConfig(block_size=4, num_blocks=128, enable_prefix_caching=False))
    got, cached, _, _ = cached_greedy(cfg)
    assert got == ref and cached == [0] * len(PROMPTS)
