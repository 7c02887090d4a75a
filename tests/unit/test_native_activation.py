"""The fused experts' activation (afd/kernels/experts.h: afd_act8, eight lanes with their own
exp) against the torch path's (services/ffn/kinds.py) on bf16 tensors: every special value
exact, and on a million random pairs at most a handful of last-bit differences (torch's exp
and this one may differ by an ulp, which rarely crosses a bf16 rounding)."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import gemm
from services.ffn.kinds import swiglu, swiglu_clamped

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)

KINDS = {"swiglu": (0, 0.0, 0.0), "swiglu_clamped": (1, 7.0, 1.702)}


def _native(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    rows, inter = gate.shape
    act, limit, alpha = KINDS[kind]
    gu = torch.cat([gate, up], dim=1).contiguous()
    out = torch.empty(rows, inter, dtype=torch.bfloat16)
    rc = gemm._lib().afd_act_rows(gu.data_ptr(), rows, inter, act, limit, alpha, out.data_ptr())
    assert rc == 0
    return out


def _torch(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "swiglu":
        return swiglu(gate, up)
    _, limit, alpha = KINDS[kind]
    return swiglu_clamped(gate, up, limit=limit, alpha=alpha)


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # elementwise, NaN equal to NaN
    return (a == b) | (a.isnan() & b.isnan())


@pytest.mark.parametrize("kind", list(KINDS))
def test_special_values_match_torch(kind):
    specials = [0.0, -0.0, 1.0, -1.0, 7.0, -7.0, 8.0, -8.0, 88.5, -88.5, 89.0, -89.0, 100.0]
    specials += [-100.0, 1e30, -1e30, 1e-30, -1e-30, float("inf"), float("-inf"), float("nan")]
    v = torch.tensor(specials, dtype=torch.float32)
    gate = v.repeat_interleave(len(specials)).view(-1, 1)
    up = v.repeat(len(specials)).view(-1, 1)
    pad = 8 - 1  # the kernel takes rows of a multiple of 8: pad with copies of the first column
    gate = torch.cat([gate, gate.expand(-1, pad)], 1).to(torch.bfloat16)
    up = torch.cat([up, up.expand(-1, pad)], 1).to(torch.bfloat16)
    got, want = _native(gate, up, kind), _torch(gate, up, kind)
    assert _same(got, want).all(), (gate[~_same(got, want)], up[~_same(got, want)])


@pytest.mark.parametrize("kind", list(KINDS))
def test_random_pairs_differ_from_torch_in_at_most_a_handful_of_last_bits(kind):
    g = torch.Generator().manual_seed(7)
    shape = (1024, 1024)
    gate = (torch.randn(shape, generator=g) * 4).to(torch.bfloat16)
    up = (torch.randn(shape, generator=g) * 4).to(torch.bfloat16)
    got, want = _native(gate, up, kind), _torch(gate, up, kind)
    differ = ~_same(got, want)
    assert differ.sum().item() <= 4  # of 1,048,576 (none, measured on torch 2.13)
    # and only by one bf16 ulp
    gi, wi = got[differ].view(torch.int16).int(), want[differ].view(torch.int16).int()
    assert ((gi - wi).abs() <= 1).all()
