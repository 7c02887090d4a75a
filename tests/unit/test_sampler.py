"""The sampler (services/attention/sampler.py): every sampled row filtered and drawn at once,
against a row-by-row reference of top-k / top-p written here; seeds; logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from afd.control import SamplingParams
from services.attention.sampler import _filtered, sample

V = 50


def _reference_row(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, plainly: keep the top_k largest (ties kept), then the smallest prefix of the
    sorted tokens whose mass before each kept token is below top_p."""
    x = x / p.temperature
    keep = torch.ones(V, dtype=torch.bool)
    if p.top_k and 0 < p.top_k < V:
        keep &= x >= torch.sort(x, descending=True).values[p.top_k - 1]
    if p.top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), -1)
        order = torch.argsort(probs, descending=True)
        mass = 0.0
        for rank, t in enumerate(order.tolist()):
            if rank > 0 and mass >= p.top_p:
                keep[t] = False
            mass += float(probs[t])
    return x.masked_fill(~keep, -math.inf)


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.8),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
]


def test_rows_filtered_together_match_the_row_by_row_reference():
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(0)) * 3
    got = _filtered(logits, PARAMS)
    for i, p in enumerate(PARAMS):
        ref = _reference_row(logits[i], p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref)), i
        kept = ~torch.isinf(ref)
        torch.testing.assert_close(got[i][kept], ref[kept])


def test_draws_stay_inside_each_rows_top_k_and_top_p():
    torch.manual_seed(0)  # the unseeded rows draw from torch's global generator
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), V, generator=g) * 3
    allowed = [~torch.isinf(_reference_row(logits[i], p)) for i, p in enumerate(PARAMS)]
    seen = [set() for _ in PARAMS]
    for _ in range(200):
        tokens, _, _ = sample(logits, PARAMS, [None] * len(PARAMS))
        for i, t in enumerate(tokens):
            assert allowed[i][t], (i, t)
            seen[i].add(t)
    assert seen[4] == {int(logits[4].argmax())} and seen[5] == {int(logits[5].argmax())}
    assert len(seen[0]) > 2  # a plain temperature row does sample


def test_a_seeded_row_draws_the_same_alone_or_in_a_batch():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, seed=7)

    def draws(rows):
        gen = torch.Generator().manual_seed(7)
        out = []
        for _ in range(5):
            others = [None] * (rows - 1)
            params = [p] + [SamplingParams(temperature=1.0)] * (rows - 1)
            tokens, _, _ = sample(logits[:rows], params, [gen, *others])
            out.append(tokens[0])
        return out

    assert draws(1) == draws(3)


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_of_the_chosen_token_and_the_top_n(greedy):
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    t = 0.0 if greedy else 1.0
    params = [SamplingParams(temperature=t, logprobs=3), SamplingParams(temperature=t)]
    tokens, lps, _ = sample(logits, params, [None, None])
    logp = torch.log_softmax(logits[0], -1)
    assert lps[1] is None and lps[0].token_id == tokens[0]
    assert lps[0].logprob == pytest.approx(float(logp[tokens[0]]))
    top = torch.topk(logp, 3)
    assert [a for a, _ in lps[0].top] == top.indices.tolist()


def test_logprobs_stay_the_models_own_under_restrictions():
    """allowed_token_ids, bans (min_tokens, bad words) choose the token; the logprobs reported
    are still the model's own distribution's, as vLLM's raw logprobs are."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    raw = torch.log_softmax(logits[0], dim=-1)
    p = SamplingParams(temperature=0, logprobs=2, allowed_token_ids=(2, 3))
    tokens, lps, empty = sample(logits.clone(), [p], [None], banned=[[2]])
    assert tokens == [3] and empty == []
    assert lps[0].logprob == pytest.approx(raw[3].item())
    assert [t for t, _ in lps[0].top] == [0, 1]
    assert [v for _, v in lps[0].top] == pytest.approx(raw[:2].tolist())
    _, _, empty = sample(logits.repeat(2, 1), [p, SamplingParams(temperature=1.0)], [None, None],
                         banned=[[2, 3], []])  # fmt: skip
    assert empty == [0]


@pytest.mark.parametrize(
    "change",
    ["none", "logprobs", "penalty", "bias", "allowed", "banned", "masked", "sampled"],
)
def test_a_precomputed_argmax_is_taken_only_for_plain_greedy_rows(change):
    """The caller's argmax (the decode stack's head computes it beside the logits) answers a
    step whose rows are all greedy with nothing that changes their logits or asks for
    logprobs; any of those and the sampler reads the logits itself. A wrong hint tells which
    happened."""
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    kw = {
        "logprobs": {"logprobs": 1},
        "penalty": {"repetition_penalty": 1.3},
        "bias": {"logit_bias": ((3, 5.0),)},
        "allowed": {"allowed_token_ids": (1, 2, 3)},
        "sampled": {"temperature": 0.8, "seed": 1},
    }.get(change, {})
    plain = SamplingParams(temperature=0)
    params = [plain, SamplingParams(**{"temperature": 0, **kw})]
    banned = [(), (int(logits[1].argmax()),)] if change == "banned" else [(), ()]
    wrong = (logits.argmax(-1) + 1) % V

    def run(hint):
        return sample(
            logits.clone(), params, [None, None], [[], []], [[], []], banned,
            change == "masked", hint,
        )[0]  # fmt: skip

    taken = run(wrong)
    if change == "none":
        assert taken == wrong.tolist()
    else:  # row 0 is plain greedy: its own argmax, not the hint's
        assert taken[0] == int(logits[0].argmax())
        if change != "sampled":  # the unseeded draw aside, what the sampler gives unhinted
            assert taken == run(None)
