"""afd's greedy tokens against Hugging Face transformers on the same checkpoint, for every
family transformers runs (tests/helpers/checkpoints.py: TRANSFORMERS_REFERENCED).

float32 with an fp32 wire: the tokens must be identical. bf16 with a bf16 wire: each token
afd picks is judged against the float32 reference teacher-forced on afd's own tokens: at 90%
of steps or more it must be the reference's argmax, and at every step within BF16_GAP of the
reference's best logit (a near-tie, not a bug). Where bf16 rounding moves a model by more than
that (attention that selects tokens, DeepSeek Sparse Attention: a flipped selection; gpt-oss's
clamped experts and sinks: transformers' own bf16 forward agrees with its float32 one at 89%
of steps on the test prompts), afd's bf16 must stay as close to the float32 reference as
transformers' own bf16 forward does on the same prompts (its worst gap, and its agreement
less 5 points), whichever bound is looser.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd_cli.local import local_engine
from tests.helpers.checkpoints import (
    REFERENCE_CHECKPOINTS,
    TRANSFORMERS_REFERENCED,
    greedy_gaps,
    hf_greedy,
    hf_model,
)

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 57)), [7, 7, 7], list(range(100, 119))]
NEW = 16
# Largest logit gap tolerated for a bf16 disagreement. The checkpoints' logits have a std of
# ~1.6; transformers' own bf16 forward strays up to ~0.6 from its float32 forward on them.
BF16_GAP = 0.75


def engine_cfg(path, dtype="float32", S=1, blocks=128, budget=24, **kw) -> EngineConfig:
    mc = ModelConfig.from_hf(path)
    return EngineConfig(
        model=mc,
        dtype=dtype,
        a2f_dtype="fp32" if dtype == "float32" else "bf16",
        micro_batches=S,
        cache=CacheConfig(block_size=4, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        **kw,
    )


def afd_greedy(cfg: EngineConfig, prompts=PROMPTS, num_ffn=1):
    with local_engine(cfg, num_ffn, progress=False) as eng:
        reqs = eng.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks, "KV blocks leaked"
        return [r.output_token_ids for r in reqs], eng.scheduler.num_preemptions


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """model_type -> (checkpoint, float32 transformers model, its greedy tokens)."""
    out = {}
    for model_type in TRANSFORMERS_REFERENCED:
        path = REFERENCE_CHECKPOINTS[model_type](tmp_path_factory.mktemp(model_type) / "ckpt")
        m = hf_model(path, torch.float32)
        out[model_type] = (path, m, hf_greedy(m, PROMPTS, NEW))
    return out


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
@pytest.mark.parametrize("S", [1, 2, 3])
def test_fp32_tokens_identical(refs, family, S):
    path, _, ref = refs[family]
    got, _ = afd_greedy(engine_cfg(path, S=S))
    assert got == ref


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
def test_chunked_prefill_and_preemption(refs, family):
    path, _, ref = refs[family]
    # 16 blocks of 4 slots cannot hold all four sequences at once: requests get preempted and
    # recomputed; a budget of 8 tokens splits every longer prompt into chunks.
    got, preemptions = afd_greedy(engine_cfg(path, S=2, blocks=16, budget=8))
    assert preemptions > 0
    assert got == ref


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
def test_priority_scheduling_under_preemption(refs, family):
    """--scheduling-policy priority on a pool too small for all four: the most urgent request
    arrives last, after two steps, and is never the one preempted; every output stays the
    reference's."""
    path, _, ref = refs[family]
    cfg = engine_cfg(path, S=2, blocks=16, budget=8)
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, scheduling_policy="priority"))

    def params(priority: int) -> SamplingParams:
        return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, priority=priority)

    with local_engine(cfg, 1, progress=False) as eng:
        reqs = [eng.add_request(p, params(i)) for i, p in enumerate(PROMPTS[:3])]
        for _ in range(2):
            eng.step()
        reqs.append(eng.add_request(PROMPTS[3], params(-1)))
        while eng.has_unfinished():
            eng.step()
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks, "KV blocks leaked"
        assert eng.scheduler.num_preemptions > 0
    assert reqs[3].num_preemptions == 0
    assert [r.output_token_ids for r in reqs] == ref


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
def test_bf16_within_near_tie_tolerance(refs, family, kernel_path):
    """On every kernel path this machine runs (AFD_KERNELS): afd's kernels, oneDNN, torch."""
    path, ref_model, _ = refs[family]
    cfg = engine_cfg(path, dtype="bfloat16", S=2)
    hf_gap, hf_agree = _hf_bf16(family, path, ref_model)
    max_gap, min_agree = max(BF16_GAP, hf_gap), min(0.9, hf_agree - 0.05)
    gap, agree = _gaps_summary(ref_model, afd_greedy(cfg)[0])
    assert gap <= max_gap, f"afd chose a token {gap:.3f} below the reference best"
    assert agree >= min_agree, f"afd bf16 agrees with the reference argmax at only {agree:.0%}"


_HF_BF16: dict[str, tuple[float, float]] = {}


def _hf_bf16(family: str, path, ref_model) -> tuple[float, float]:
    """transformers' own bf16 greedy against its float32 reference (computed once a family)."""
    if family not in _HF_BF16:
        hf = hf_greedy(hf_model(path, torch.bfloat16), PROMPTS, NEW)
        _HF_BF16[family] = _gaps_summary(ref_model, hf)
    return _HF_BF16[family]


def _gaps_summary(ref_model, got: list[list[int]]) -> tuple[float, float]:
    """(the worst gap below the reference's best logit, the share of steps at its argmax)."""
    gaps = [
        g for p, toks in zip(PROMPTS, got, strict=True) for g in greedy_gaps(ref_model, p, toks)
    ]
    return max(gaps), sum(g == 0.0 for g in gaps) / len(gaps)


def test_expert_parallel_shards_sum_exactly(refs):
    path, _, ref = refs["qwen3_moe"]
    got, _ = afd_greedy(engine_cfg(path, S=2), num_ffn=3)  # 3 does not divide 8 experts
    assert got == ref


# --- planted bugs: each must make the comparison above fail ------------------------------


def test_planted_rope_frequency_bug_is_caught(refs):
    path, _, ref = refs["qwen3_moe"]
    cfg = engine_cfg(path, S=2)
    cfg = replace(cfg, model=replace(cfg.model, rope_theta=cfg.model.rope_theta * 2))
    assert afd_greedy(cfg)[0] != ref


def test_planted_topk_off_by_one_is_caught(refs):
    path, _, ref = refs["mixtral"]
    cfg = engine_cfg(path, S=1)
    cfg = replace(cfg, model=replace(cfg.model, top_k=cfg.model.top_k - 1))
    assert afd_greedy(cfg)[0] != ref


def test_planted_zeroed_expert_is_caught(refs, monkeypatch):
    path, _, ref = refs["qwen3_moe"]
    from services.ffn import engine as ffn_engine

    real_init = ffn_engine.FFNEngine.__init__

    def init_zero_one_expert(self, *a, **kw):
        real_init(self, *a, **kw)
        first_moe = min(self.experts)
        self.experts[first_moe].w13[3].w.zero_()  # expert 3 of the first MoE layer outputs 0

    monkeypatch.setattr(ffn_engine.FFNEngine, "__init__", init_zero_one_expert)
    assert afd_greedy(engine_cfg(path, S=1))[0] != ref


def test_planted_kv_slot_off_by_one_is_caught(refs, monkeypatch):
    path, _, ref = refs["qwen3_moe"]
    from services.attention import batch

    real = batch._slots
    monkeypatch.setattr(batch, "_slots", lambda blocks, pos, bs: real(blocks, pos, bs) + 1)
    assert afd_greedy(engine_cfg(path, S=1))[0] != ref


# --- YaRN on a family other than DeepSeek (the RoPE scaling is read for every family) ------

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(scope="module")
def qwen3_yarn(tmp_path_factory):
    from tests.helpers.checkpoints import qwen3_moe

    path = qwen3_moe(tmp_path_factory.mktemp("yarn") / "ckpt", rope_parameters=YARN)
    return path, hf_greedy(hf_model(path, torch.float32), PROMPTS, NEW)


def test_yarn_rope_matches_transformers(qwen3_yarn):
    path, ref = qwen3_yarn
    assert ModelConfig.from_hf(path).rope_scaling.factor == 4.0
    assert afd_greedy(engine_cfg(path, S=2))[0] == ref


def test_planted_yarn_ignored_is_caught(qwen3_yarn):
    path, ref = qwen3_yarn
    cfg = engine_cfg(path, S=2)
    assert afd_greedy(replace(cfg, model=replace(cfg.model, rope_scaling=None)))[0] != ref


def test_other_rope_scalings_are_refused(qwen3_yarn):
    import json

    from afd.errors import ConfigError

    raw = json.loads((qwen3_yarn[0] / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ConfigError, match="rope scaling 'linear' is not supported"):
        ModelConfig.from_dict(raw)
