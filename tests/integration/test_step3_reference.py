"""Families transformers cannot run (step3_text: MFA, shared expert, dense layers) against an
independent dense reference forward of our own (tests/helpers/checkpoints.py: DENSE_REFERENCES;
full recompute, no KV cache), float32, exact tokens."""

from __future__ import annotations

import pytest

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd_cli.local import local_engine
from tests.helpers.checkpoints import DENSE_REFERENCES, REFERENCE_CHECKPOINTS

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(30, 71)), [9]]
NEW = 12


@pytest.fixture(scope="module", params=sorted(DENSE_REFERENCES))
def checked(request, tmp_path_factory):
    """(model_type, checkpoint, the dense reference's greedy tokens), one family at a time."""
    model_type = request.param
    path = REFERENCE_CHECKPOINTS[model_type](tmp_path_factory.mktemp(model_type) / "ckpt")
    return model_type, path, DENSE_REFERENCES[model_type](path, PROMPTS, NEW)


def test_step3_checkpoint_has_mfa_a_shared_expert_and_dense_layers(tmp_path):
    mc = ModelConfig.from_hf(REFERENCE_CHECKPOINTS["step3_text"](tmp_path / "ckpt"))
    assert mc.attention == "mfa" and mc.shared_expert_intermediate_size > 0
    assert mc.moe_layers == (False, True, True, False)


@pytest.mark.parametrize("S,num_ffn", [(1, 1), (2, 2), (3, 3)])
def test_matches_dense_reference(checked, S, num_ffn):
    _, path, ref = checked
    cfg = EngineConfig(
        model=ModelConfig.from_hf(path),
        dtype="float32",
        a2f_dtype="fp32",
        micro_batches=S,
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
    )
    with local_engine(cfg, num_ffn, progress=False) as eng:
        reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    assert [r.output_token_ids for r in reqs] == ref
