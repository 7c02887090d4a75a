"""Prompt logprobs in the engine: each prompt token's log-probability given the tokens before
it equals transformers' teacher-forced float32 log-softmax, for every family transformers runs,
through chunked prefill, preemption and micro-batches; a request for no token (max_tokens 0)
only scores its prompt; nothing is scored twice after a recompute."""

from __future__ import annotations

import pytest
import torch

from afd.control import SamplingParams
from afd_cli.local import local_engine
from tests.helpers.checkpoints import (
    REFERENCE_CHECKPOINTS,
    TRANSFORMERS_REFERENCED,
    hf_logits,
    hf_model,
)
from tests.integration.test_engine_reference import PROMPTS, engine_cfg


def _reference(model, prompt: list[int]) -> torch.Tensor:  # [n - 1]
    logp = torch.log_softmax(hf_logits(model, prompt), dim=-1)
    return logp[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
def test_prompt_logprobs_equal_transformers(family, tmp_path):
    path = REFERENCE_CHECKPOINTS[family](tmp_path / "ckpt")
    ref = hf_model(path, torch.float32)
    params = [
        SamplingParams(max_tokens=0, prompt_logprobs=2),
        SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=0, prompt_logprobs=0),
        SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1, ignore_eos=True),
    ]
    # 12 blocks of 4 slots and a budget of 8 tokens: chunked prefills and preemptions
    with local_engine(engine_cfg(path, S=2, blocks=12, budget=8), progress=False) as eng:
        reqs = eng.generate(PROMPTS, params)
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        preempted = eng.scheduler.num_preemptions
    assert [len(r.output_token_ids) for r in reqs] == [0, 4, 0, 6]
    assert [r.finish_reason for r in reqs] == ["length"] * 4
    assert preempted > 0  # and a recomputed prefill scores nothing twice
    for p, r, sp in zip(PROMPTS, reqs, params, strict=True):
        got = torch.tensor([lp.logprob for lp in r.prompt_logprobs])
        assert [lp.token_id for lp in r.prompt_logprobs] == p[1:]
        torch.testing.assert_close(got, _reference(ref, p), rtol=0, atol=2e-4)
        assert all(len(lp.top) == sp.prompt_logprobs for lp in r.prompt_logprobs)


def test_top_alternatives_are_the_best_tokens(tmp_path):
    path = REFERENCE_CHECKPOINTS["qwen3_moe"](tmp_path / "ckpt")
    ref = hf_model(path, torch.float32)
    p = PROMPTS[1]
    with local_engine(engine_cfg(path, S=1), progress=False) as eng:
        r, other = eng.generate(
            [p, p], [SamplingParams(max_tokens=0, prompt_logprobs=3), SamplingParams(max_tokens=2)]
        )
    assert other.prompt_logprobs == []  # not asked, not computed
    best = torch.log_softmax(hf_logits(ref, p), dim=-1)[:-1].topk(3, dim=-1)
    for lp, ids, vals in zip(r.prompt_logprobs, best.indices, best.values, strict=True):
        assert [t for t, _ in lp.top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), vals, atol=2e-4, rtol=0)
