"""sample.c draws from the distribution that sampler.py's filters leave: with N evenly spaced
uniform numbers an inverse-CDF draw gives each token N * p of them, to within one, so the
counts must equal the reference probabilities to within 1/N, and a token the filters drop is
never drawn. Tokens with equal logits are compared as one group: where top-p's cut falls
inside such a tie, which of them stay is the sort's order, arbitrary in torch's."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import gemm
from afd.kernels.sample import Draws, rows
from afd.sampling import SamplingParams
from services.attention.sampler import _filtered

pytestmark = pytest.mark.skipif(not gemm.available(), reason="the native library is not built")

N = 20000
V = 96


def _row(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, generator=g) * 2.0
    x[5] = x[6] = x[7] = x.max() - 0.5  # ties at what top-k and top-p cut
    x[10:14] = float("-inf")  # banned tokens (a grammar's, a bias of -inf)
    return x


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_k=7),  # the tie at the k-th: all three kept
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.35),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=2.0, top_k=-1, top_p=0.999),
]


def _counts(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    draws = Draws.of([p] * N, 1)
    assert draws is not None
    spaced = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    draws = Draws(draws.temperature, draws.top_k, draws.top_p, draws.min_p, spaced.float()[None])
    out = torch.full((N,), -1, dtype=torch.long)
    rows(x.expand(N, V).contiguous(), draws, out)
    assert out.min() >= 0
    return torch.bincount(out, minlength=V).double() / N


@pytest.mark.parametrize(
    "p", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
@pytest.mark.parametrize("seed", [0, 1])
def test_draws_follow_the_filtered_distribution(p, seed):
    x = _row(seed)
    want = torch.softmax(_filtered(x[None].clone(), [p]), dim=-1)[0].double()
    got = _counts(x, p)
    for v in x.unique():
        group = x == v
        g, w = got[group].sum().item(), want[group].sum().item()
        assert w > 0 or g == 0, f"a filtered-out token was drawn (logit {v})"
        assert abs(g - w) <= group.sum().item() / N + 1e-5, (v, g, w)


def test_greedy_rows_keep_their_argmax_and_sampled_rows_are_drawn():
    x = torch.stack([_row(0), _row(1), _row(2)])
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0)]
    draws = Draws.of(params, 1)
    out = torch.tensor([-7, -7, -9])
    rows(x, draws, out)
    assert out[0] == -7 and out[2] == -9 and 0 <= out[1] < V
    assert Draws.of([SamplingParams(temperature=0.0)] * 2, 3) is None
