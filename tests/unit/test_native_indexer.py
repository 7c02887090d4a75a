"""The sparse-attention indexer's native scores (afd/kernels/indexer.c) against the torch path
they replace in services/attention/sparse_attention.select: the same scores to fp32 summation
order, the same selected tokens, for rows with their own block tables and rows sharing one; the
top-k rule both decode paths select by (afd_topk_positions)."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import indexer
from services.attention import sparse_attention
from services.attention.sparse_attention import IndexQuery


def _case(seed: int, n: int, shared: bool, Di: int = 64, hI: int = 8, nb: int = 9, bs: int = 16):
    g = torch.Generator().manual_seed(seed)
    NB = 64
    pool = torch.randn(NB, bs, Di, generator=g).to(torch.bfloat16)
    q = torch.randn(n, hI, Di, generator=g).to(torch.bfloat16)
    w = torch.randn(n, hI, generator=g) * hI**-0.5
    blocks = torch.randperm(NB, generator=g)[: nb * (1 if shared else n)].view(-1, nb)
    L = nb * bs
    lens = torch.randint(1, L + 1, (n,), generator=g)
    return IndexQuery(q, w, Di**-0.5), pool, blocks, lens


# bs 20: a last group of 4 positions; Di 40 and 16: key pairs not a multiple of 16 (and off
# AMX's tiles); 40 and 72 heads: AMX's head tiles, 3 of them, and more than the 4 summed at once
@pytest.mark.parametrize(
    "bs,Di,hI", [(16, 64, 8), (20, 40, 8), (16, 16, 8), (16, 64, 40), (20, 32, 72)]
)
@pytest.mark.parametrize("shared", [False, True])
def test_native_scores_match_the_torch_path(native_path, shared, bs, Di, hI, monkeypatch):
    iq, pool, blocks, lens = _case(0, 5, shared, Di=Di, hI=hI, bs=bs)
    assert indexer.usable(pool, iq.q)
    native = indexer.index_scores(iq.q, iq.weights, pool, blocks, iq.scale)
    G, nb = blocks.shape
    keys = pool.index_select(0, blocks.reshape(-1)).view(G, nb * pool.shape[1], -1).float()
    ref = torch.relu(torch.matmul(iq.q.float(), keys.transpose(1, 2)) * iq.scale)
    ref = torch.matmul(iq.weights.unsqueeze(1), ref).squeeze(1)
    torch.testing.assert_close(native, ref, rtol=1e-5, atol=1e-5)

    got = sparse_attention.select(iq, slice(0, 5), pool, blocks, lens, 24)
    monkeypatch.setattr(indexer, "usable", lambda *a: False)
    want = sparse_attention.select(iq, slice(0, 5), pool, blocks, lens, 24)
    assert _chosen(*got) == _chosen(*want)  # torch's topk (by score) and the native rule agree
    assert [len(row) for row in _chosen(*got)] == [min(24, n) for n in lens.tolist()]


def _chosen(slots: torch.Tensor, visible: torch.Tensor) -> list[list[int]]:
    """Each row's selected slots, ascending (the order attend_selected reads them in)."""
    return [sorted(s[v].tolist()) for s, v in zip(slots, visible, strict=True)]


def test_topk_positions_rule():
    """Among the positions a row sees: all where they are at most k (scores unread), else the k
    highest (NaN below every number), ties at the cut to the lower positions (both zeros
    alike); ascending. Scores of every order of magnitude and sign, so each of the radix
    select's three rounds decides somewhere."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3000, generator=g) * torch.logspace(-30, 30, 3000)[torch.randperm(3000)]
    x[4] = torch.randn(3000, generator=g).round(decimals=2)  # many ties
    x[5] = 1.0 + torch.randint(0, 4, (3000,), generator=g) * 2**-23  # one exponent, 4 values
    lens = torch.tensor([3000, 2999, 17, 1000, 3000, 3000])
    for k in (1, 17, 300, 2999):
        pos, count = indexer.topk_positions(x, k, lens)
        assert count.tolist() == [min(k, n) for n in lens.tolist()]
        for i, n in enumerate(lens.tolist()):
            row = x[i, :n]
            if n <= k:
                assert pos[i, :n].tolist() == list(range(n))
                continue
            cut = row.sort(descending=True, stable=True).values[k - 1]
            above = (row > cut).nonzero().flatten().tolist()
            tied = (row == cut).nonzero().flatten().tolist()[: k - len(above)]
            assert pos[i].tolist() == sorted(above + tied)
    row = torch.tensor([[1.0, 0.0, -0.0, 2.0, 0.0, float("nan"), -torch.inf, 0.5, -0.0]])
    nine = torch.tensor([9])
    assert indexer.topk_positions(row, 4, nine)[0].tolist() == [[0, 1, 3, 7]]
    assert indexer.topk_positions(row, 5, nine)[0].tolist() == [[0, 1, 2, 3, 7]]
    assert indexer.topk_positions(row, 8, nine)[0].tolist() == [[0, 1, 2, 3, 4, 6, 7, 8]]  # NaN out
    pos, count = indexer.topk_positions(None, 4, torch.tensor([3, 0]), L=9)  # unscored
    assert count.tolist() == [3, 0] and pos.tolist() == [[0, 1, 2, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="below 1"):
        indexer.topk_positions(row, 0, nine)
    with pytest.raises(ValueError, match="outside"):
        indexer.topk_positions(row, 4, torch.tensor([10]))
    with pytest.raises(ValueError, match="without"):
        indexer.topk_positions(None, 4, torch.tensor([5]), L=9)


def test_a_block_outside_the_pool_is_an_error(native_path):
    iq, pool, blocks, _ = _case(1, 2, True)
    blocks = blocks.clone()
    blocks[0, 3] = pool.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        indexer.index_scores(iq.q, iq.weights, pool, blocks, iq.scale)


@pytest.mark.parametrize("nh", [16, 4])
def test_the_selected_rows_are_attended_by_the_native_kernel(native_path, nh, monkeypatch):
    """attend_selected on afd's kernels: the decode kernel reads the selected latent rows in
    place (one-row blocks, each row's visible ones first), against the gather and batched
    matmuls within bf16's tolerance; picks that are not visible anywhere in a row (a context
    shorter than topk) and a row with one visible pick; each row alone gives the batch's
    bits. 16 heads: the AMX tiles where the path has them."""
    g = torch.Generator().manual_seed(nh)
    D, dv, rows, n, k = 288, 256, 600, 5, 40
    pool = torch.randn(rows, D, generator=g).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(n)])
    visible = torch.rand(n, k, generator=g) < 0.7
    visible[0] = True
    visible[1] = False
    visible[1, 17] = True
    q = torch.randn(n, nh, D, generator=g).to(torch.bfloat16)
    calls, real = [], sparse_attention.decode_attention

    def record(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(sparse_attention, "decode_attention", record)
    got = sparse_attention.attend_selected(q, pool, slots, visible, dv, D**-0.5)
    alone = [
        sparse_attention.attend_selected(q[i : i + 1], pool, slots[i : i + 1],
                                         visible[i : i + 1], dv, D**-0.5)
        for i in range(n)
    ]  # fmt: skip
    assert calls == [n] + [1] * n
    monkeypatch.setattr(sparse_attention, "latent_native", lambda *a: False)
    want = sparse_attention.attend_selected(q, pool, slots, visible, dv, D**-0.5)
    assert got.shape == want.shape == (n, nh * dv)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-9)
    assert (got == want).float().mean() > 0.98
    assert torch.equal(got.view(torch.int16), torch.cat(alone).view(torch.int16))
