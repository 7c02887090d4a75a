"""The fused MXFP4 experts call (mxfp4_moe.c) against the torch path it replaces
(services/ffn/experts.py's loop over experts, each matmul on afd's MXFP4 kernel): the same
bits, with and without biases, for both activations it computes, on every native kernel path."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from afd.mxfp4 import MXFP4, quantize
from afd.ops import Linear
from services.ffn.experts import ExpertGroup, routed_experts
from services.ffn.kinds import swiglu, swiglu_clamped
from tests.helpers.kernels import NATIVE, NO_NATIVE

H, INTER, E, K = 64, 96, 6, 3  # INTER: 3 blocks, an odd last block on the w2 side

ACTS = {
    "swiglu": swiglu,
    "swiglu_clamped": partial(swiglu_clamped, limit=7.0, alpha=1.702),
}


def _experts(seed: int, biased: bool, act: str, first: int = 2) -> ExpertGroup:
    g = torch.Generator().manual_seed(seed)

    def lin(n: int, k: int) -> Linear:
        w = MXFP4(*quantize(torch.randn(n, k, generator=g) * 0.3))
        b = torch.randn(n, generator=g).bfloat16() if biased else None
        return Linear(w, b)

    w13 = [lin(2 * INTER, H) for _ in range(E)]
    w2 = [lin(H, INTER) for _ in range(E)]
    return ExpertGroup.build(first, w13, w2, ACTS[act], act_spec=(act, 7.0, 1.702))


def _routing(seed: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 2).bfloat16()
    # global ids 0..E+3: some below and above this shard's 2..E+1
    ids = torch.stack([torch.randperm(E + 4, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return x, ids, w


@pytest.mark.parametrize("kernel_path", NATIVE or [pytest.param("none", marks=NO_NATIVE)])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("biased", [True, False])
def test_fused_experts_give_the_torch_paths_bits(kernel_path, act, biased):
    from afd.kernels import paths

    with paths.use(kernel_path):
        group = _experts(1, biased, act)
        assert group.fused_mx is not None
        loop = replace(group, fused_mx=None)
        for T in (1, 5, 33):
            x, ids, w = _routing(T, T)
            base = (torch.randn(T, H) * 0.1).bfloat16()
            fused = routed_experts(x, ids, w, group, base.clone())
            want = routed_experts(x, ids, w, loop, base.clone())
            assert not torch.equal(want, base)
            assert torch.equal(fused, want), (T, (fused != want).sum().item())


@pytest.mark.parametrize("kernel_path", NATIVE or [pytest.param("none", marks=NO_NATIVE)])
def test_planted_bias_dropped_is_caught(kernel_path, monkeypatch):
    """The comparison above can fail: the fused call without its up/gate biases differs."""
    from afd.kernels import paths

    with paths.use(kernel_path):
        group = _experts(1, True, "swiglu_clamped")
        loop = replace(group, fused_mx=None)
        monkeypatch.setattr(
            group.fused_mx, "_p", [*group.fused_mx._p[:2], None, *group.fused_mx._p[3:]]
        )
        x, ids, w = _routing(5, 5)
        base = torch.zeros(5, H, dtype=torch.bfloat16)
        fused = routed_experts(x, ids, w, group, base.clone())
        assert not torch.equal(fused, routed_experts(x, ids, w, loop, base.clone()))
