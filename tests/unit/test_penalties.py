"""Biases and penalties on the logits (services/attention/penalties.py) against transformers'
own logits processors on random logits of both signs, and min-p against its MinPLogitsWarper;
the logprobs a request gets stay the model's own."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from afd.control import SamplingParams
from services.attention.penalties import adjust_
from services.attention.sampler import _filtered, sample

V = 64


def _histories(B: int, gen: torch.Generator) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [torch.randint(0, V, (int(n),), generator=gen).tolist() for n in range(3, 3 + B)]
    # few distinct tokens: outputs repeat them, so counts above 1 are met
    outputs = [torch.randint(0, 12, (2 * n,), generator=gen).tolist() for n in range(B)]
    return prompts, outputs


def _reference(logits, p: SamplingParams, prompt: list[int], output: list[int]):
    """One row through transformers' processors (bias, repetition) and OpenAI's formula."""
    row = logits.unsqueeze(0).clone()
    ids = torch.tensor([prompt + output])
    if p.logit_bias:
        row = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias])(ids, row)
    if p.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, row)
    counts = torch.zeros(V)
    for t in output:
        counts[t] += 1
    row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    return row[0]


def test_each_row_gets_its_own_penalties_as_transformers_applies_them():
    gen = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(),  # untouched
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(repetition_penalty=0.6),  # < 1 favours repeats
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(logit_bias=((1, 5.0), (7, -100.0))),
        SamplingParams(
            logit_bias=((2, -3.0),),
            repetition_penalty=1.3,
            frequency_penalty=1.1,
            presence_penalty=0.9,
        ),
    ]
    logits = torch.randn(len(params), V, generator=gen) * 3  # both signs
    prompts, outputs = _histories(len(params), gen)
    got = logits.clone()
    adjust_(got, params, prompts, outputs)
    for i, p in enumerate(params):
        assert torch.equal(got[i], _reference(logits[i], p, prompts[i], outputs[i])), i
    assert torch.equal(got[0], logits[0])


def test_greedy_follows_the_penalties_and_logprobs_stay_the_models():
    logits = torch.tensor([[4.0, 3.9, -1.0, 0.0]])
    raw = torch.log_softmax(logits, -1)
    p = SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=1)
    tokens, lps, _ = sample(logits.clone(), [p], [None], [[0]], [[]])
    assert tokens == [1]  # 4.0 / 1.5 < 3.9
    assert lps[0].logprob == pytest.approx(raw[0, 1].item())  # not the penalized one
    assert lps[0].top[0] == (0, pytest.approx(raw[0, 0].item()))
    with pytest.raises(ValueError, match="prompt and output"):
        sample(logits, [p], [None])


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9, 1.0])
def test_min_p_keeps_what_transformers_keeps(min_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=gen) * 2
    params = [SamplingParams(temperature=t, min_p=min_p) for t in (0.5, 1.0, 1.5, 2.0)]
    got = _filtered(logits, params)
    for i, p in enumerate(params):
        ref = MinPLogitsWarper(min_p)(None, (logits[i] / p.temperature).unsqueeze(0))[0]
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(ref)), (i, min_p)
    draws = [sample(logits[:1], params[:1], [None])[0][0] for _ in range(200)]
    assert all(torch.isfinite(got[0, t]) for t in draws)
