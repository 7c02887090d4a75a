"""Greedy decoding's native argmax (afd/kernels/argmax.c) against torch.argmax: random rows,
ties (the first of equal maxima), NaN (the first NaN), rows of -inf, every width of the last
partial set of lanes; and the sampler takes it for greedy rows."""

from __future__ import annotations

import pytest
import torch

from afd.control import SamplingParams
from afd.kernels import argmax, gemm
from services.attention.sampler import sample

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)


@pytest.mark.parametrize("V", [1, 7, 8, 31, 32, 33, 64, 100, 4099, 32000])
def test_the_native_argmax_is_torchs(V):
    gen = torch.Generator().manual_seed(V)
    B = 9
    x = torch.randn(B, V, generator=gen)
    x[1] = torch.randint(0, 3, (V,), generator=gen).float()  # ties everywhere
    x[2] = float("-inf")
    x[3] = float("-inf")
    x[3, V - 1] = -1e30  # the only finite value, last
    x[4, V // 2] = float("nan")
    x[4, V - 1] = float("nan")  # the first NaN wins
    x[5, V - 1] = float("nan")
    x[6] = 0.0
    x[6, V // 3] = -0.0  # equal to 0: the first index still wins
    x[7, 0] = x[7].max() + 1  # the first element the largest
    x[8, V - 1] = x[8].max() + 1  # the last element the largest
    assert torch.equal(argmax.rows(x), x.argmax(dim=-1))


def test_usable_only_for_contiguous_float32_rows():
    assert argmax.usable(torch.zeros(2, 5))
    assert not argmax.usable(torch.zeros(2, 5, dtype=torch.bfloat16))
    assert not argmax.usable(torch.zeros(5, 2).t())
    assert not argmax.usable(torch.zeros(5))


def test_greedy_rows_sample_the_native_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=gen)
    params = [SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=0, seed=1)] * 2
    want = logits.argmax(dim=-1).tolist()
    tokens, _, _ = sample(logits.clone(), params, [None] * 4)
    assert tokens == want
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)] * 2
    tokens, _, _ = sample(logits.clone(), mixed, [None, torch.Generator().manual_seed(3)] * 2)
    assert [tokens[0], tokens[2]] == [want[0], want[2]]
