"""The grammar mask kernel (afd/kernels/bitmask.c) on random masks against the bitmask's
definition and xgrammar's own CPU routine: the same logits bit for bit, every width of the
last word, only the listed rows touched."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import bitmask, gemm

xgr = pytest.importorskip("xgrammar")

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)


@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 320, 4099])
def test_the_mask_equals_xgrammars(V):
    gen = torch.Generator().manual_seed(V)
    B = 6
    mask = xgr.allocate_token_bitmask(B, V)
    mask.copy_(torch.randint(-(2**31), 2**31 - 1, mask.shape, generator=gen, dtype=torch.int32))
    mask[1].fill_(-1)  # everything allowed
    mask[2].fill_(0)  # nothing allowed
    if V % 32:  # no bit past the vocabulary, as a grammar fills it (xgrammar aborts on one)
        mask[:, -1] &= (1 << (V % 32)) - 1
    logits = torch.randn(B, V, generator=gen)
    rows = [0, 1, 2, 4]
    # the definition: bit t % 32 of word t // 32 allows token t
    t = torch.arange(V)
    allowed = (mask[:, t // 32] >> (t % 32)) & 1 == 1  # [B, V]
    want = logits.clone()
    want[rows] = logits[rows].masked_fill(~allowed[rows], float("-inf"))
    if V >= 32:  # xgrammar's own routine agrees (below one word it masks other rows too)
        theirs = logits.clone()
        xgr.apply_token_bitmask_inplace(theirs, mask, indices=rows)
        assert torch.equal(theirs, want)
    got = logits.clone()
    assert bitmask.usable(got, mask)
    bitmask.apply_(got, mask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[3], logits[3]) and torch.equal(got[5], logits[5])
    assert torch.isinf(got[2]).all() and torch.equal(got[1], logits[1])
