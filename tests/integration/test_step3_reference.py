"""step3_text (MFA, shared expert, dense layers) against an independent dense reference forward
(tests/reference/step3_dense.py: full recompute, no KV cache), float32, exact tokens."""

from __future__ import annotations

import pytest

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd.demo import TINY_CONFIG, write_step3_checkpoint
from afd.local import local_engine
from tests.reference import step3_dense

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(30, 71)), [9]]
NEW = 12


@pytest.fixture(scope="module")
def step3(tmp_path_factory):
    cfg = {**TINY_CONFIG, "num_hidden_layers": 4, "moe_layers_enum": "1,2"}  # dense 0 and 3
    path = write_step3_checkpoint(
        tmp_path_factory.mktemp("s3") / "ckpt", cfg, seed=3, init_std=0.2, shards=2
    )
    state, rcfg = step3_dense.load_state(path), step3_dense.load_config(path)
    ref = [step3_dense.greedy_generate(state, rcfg, p, NEW, ignore_eos=True) for p in PROMPTS]
    return path, ref


@pytest.mark.parametrize("S,num_ffn", [(1, 1), (2, 2), (3, 3)])
def test_step3_matches_dense_reference(step3, S, num_ffn):
    path, ref = step3
    mc = ModelConfig.from_hf(path)
    assert mc.attention == "mfa" and mc.shared_expert_intermediate_size > 0
    assert mc.moe_layers == (False, True, True, False)
    cfg = EngineConfig(
        model=mc,
        dtype="float32",
        a2f_dtype="fp32",
        micro_batches=S,
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
    )
    with local_engine(cfg, num_ffn, progress=False) as eng:
        reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    assert [r.output_token_ids for r in reqs] == ref
