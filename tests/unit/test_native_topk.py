"""topk.c's replay of torch.topk on the CPU (afd/kernels/topk.py): the same experts in the same
order on rows full of ties, on orders built to push its introselect to the heap select, and on
plain scores; the shapes it does not follow are said so."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import gemm, topk

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)

# the last four: k * 64 <= E, where torch takes std::partial_sort
SHAPES = [(8, 1), (8, 2), (16, 4), (32, 4), (32, 8), (60, 4), (64, 6), (128, 8), (256, 8), (40, 17),
          (64, 1), (128, 2), (256, 4), (1100, 17)]  # fmt: skip


@pytest.mark.parametrize("experts,k", SHAPES)
def test_ties_pick_what_torch_picks(experts, k):
    g = torch.Generator().manual_seed(experts * 100 + k)
    rows = [torch.randint(0, n, (300, experts), generator=g).float() for n in (2, 3, 5, 50)]
    rows.append(torch.randn(300, experts, generator=g).to(torch.bfloat16).float())
    a = torch.arange(experts).float()
    shaped = [a, a.flip(0), a % 3, (a % 2) * 5, -(a - experts / 2).abs(), (a - experts / 2).abs()]
    shaped += [torch.cat([a[: experts // 2], a[: experts // 2].flip(0)])]
    for _ in range(300):  # nearly sorted, coarsened: long runs of equal values
        b = a.clone() if torch.rand(1, generator=g) < 0.5 else a.flip(0)
        i, j = torch.randint(0, experts, (2,), generator=g).tolist()
        b[[i, j]] = b[[j, i]]
        shaped.append(
            torch.div(b, int(torch.randint(1, 6, (1,), generator=g)), rounding_mode="floor")
        )
    x = torch.cat([*rows, torch.stack(shaped)])
    want = torch.topk(x, k, dim=-1).indices.to(torch.int32)
    assert torch.equal(topk.rows(x, k), want)


def test_shapes_torch_sorts_otherwise_are_not_followed():
    assert topk.known(32, 4) and topk.known(256, 8) and topk.known(40, 17)
    assert topk.known(256, 4)  # k * 64 <= E: std::partial_sort, followed too
    assert not topk.known(64, 18)  # std::sort of more than 16 sorts differently
    assert not topk.known(4, 5)
    with pytest.raises(ValueError, match="does not follow torch"):
        topk.rows(torch.zeros(2, 64), 18)


def test_the_check_passes_with_this_torch():
    """Were it to fail (a torch whose CPU topk breaks ties otherwise), ties would go back to
    torch, correct but slower; this test says so first."""
    assert topk.trust()
