"""The prefill attention's native softmax (attention.c afd_bf16_prefill_softmax, called by
services/attention/paged_attention.py's _attend on afd's CPU kernels): against torch's ops it
replaces (scale and mask in fp32, softmax, bf16), with sink logits and sliding windows; a row's
bits do not depend on the masked keys around it (chunked prefill, cached prefixes); and the
whole prefill attention against the torch path's."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import gemm, paths
from tests.helpers import kernels

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)


def _torch_probs(s, lo, hi, scale, sinks):
    """The torch path's steps on [kvh, g * n, L] bf16 scores."""
    kvh, gn, L = s.shape
    n = lo.shape[0]
    g = gn // n
    cols = torch.arange(L).view(1, -1)
    bias = torch.zeros(n, L).masked_fill_(
        (cols < lo.view(-1, 1)) | (cols >= hi.view(-1, 1)), -torch.inf
    )
    x = torch.add(bias.view(1, 1, n, L), s.view(kvh, g, n, L), alpha=scale)
    if sinks is None:
        p = torch.softmax(x, -1)
    else:
        sink = sinks.float().view(kvh, g, 1, 1).expand(kvh, g, n, 1)
        p = torch.softmax(torch.cat([x, sink], -1), -1)[..., :L]
    return p.to(torch.bfloat16).reshape(kvh, gn, L)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kvh,g,n,L", [(4, 4, 37, 48), (1, 8, 5, 80), (2, 1, 64, 64)])
def test_matches_torchs_ops(kvh, g, n, L, window, with_sinks, native_path):
    from afd.kernels.attention import prefill_softmax

    gen = torch.Generator().manual_seed(kvh * 1000 + g * 100 + n)
    s = (torch.randn(kvh, g * n, L, generator=gen) * 4).to(torch.bfloat16)
    hi = torch.arange(L - n, L) + 1  # the sequence's last n positions, causal
    lo = (hi - window).clamp(min=0) if window else torch.zeros(n, dtype=torch.long)
    sinks = torch.randn(kvh * g, generator=gen) if with_sinks else None
    got = prefill_softmax(s, lo, hi, 0.125, sinks)
    want = _torch_probs(s, lo, hi, 0.125, sinks)
    # the same bf16 values but for exp's last bits (attention.c's exp, not Sleef's)
    assert (got.float() - want.float()).abs().max() <= 2**-8
    assert (got != want).float().mean() < 0.01
    outside = (torch.arange(L).view(1, -1) < lo.view(-1, 1)) | (torch.arange(L) >= hi.view(-1, 1))
    assert not got.view(kvh, g, n, L)[:, :, outside].any()


def test_a_rows_bits_do_not_depend_on_the_masked_keys_around_it():
    """The last tokens alone (a later chunk) and the first ones over fewer keys (an earlier
    chunk, or a prefix another request cached) give the rows of the whole prefill."""
    from afd.kernels.attention import prefill_softmax

    gen = torch.Generator().manual_seed(7)
    kvh, g, n, L = 2, 4, 45, 48
    s = (torch.randn(kvh, g * n, L, generator=gen) * 4).to(torch.bfloat16).view(kvh, g, n, L)
    hi = torch.arange(L - n, L) + 1
    lo = torch.zeros(n, dtype=torch.long)
    whole = prefill_softmax(s.reshape(kvh, g * n, L), lo, hi, 0.3).view(kvh, g, n, L)
    tail = prefill_softmax(s[:, :, -5:].reshape(kvh, g * 5, L), lo[-5:], hi[-5:], 0.3)
    assert torch.equal(tail.view(kvh, g, 5, L), whole[:, :, -5:])
    keys = int(hi[9])
    head = prefill_softmax(s[:, :, :10, :keys].reshape(kvh, g * 10, keys), lo[:10], hi[:10], 0.3)
    assert torch.equal(head.view(kvh, g, 10, keys), whole[:, :, :10, :keys])


def test_rejects_an_empty_or_out_of_range_row():
    from afd.kernels.attention import prefill_softmax

    s = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="prefill_softmax"):
        prefill_softmax(s, torch.tensor([0, 0]), torch.tensor([9, 3]), 1.0)
    with pytest.raises(RuntimeError, match="prefill_softmax"):
        prefill_softmax(s, torch.tensor([2, 0]), torch.tensor([2, 3]), 1.0)


@pytest.fixture(params=["whole", "tiles"])
def tile_bytes(request, monkeypatch):
    """The prefill's scores in one tile, or in tiles of a few rows (paged_attention.py's
    causal_tiles: rows of a window see a slice of the keys)."""
    from services.attention import paged_attention as pa

    if request.param == "tiles":
        monkeypatch.setattr(pa, "_TILE_BYTES", 2048)
    return request.param


@pytest.mark.parametrize("window", [0, 5])
def test_the_prefill_attention_matches_the_torch_path(window, tile_bytes):
    """_attend with each token's keys given (afd's CPU kernels) against the torch ops on a
    shuffled block table, GQA, with sinks: the same to bf16 rounding."""
    from services.attention.paged_attention import _attend, _windowed

    gen = torch.Generator().manual_seed(11)
    kvh, nh, D, bs, NB, n, start = 2, 8, 32, 16, 12, 20, 13
    L = -(-(start + n) // bs) * bs
    k_cache = torch.randn(kvh, NB, bs, D, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(kvh, NB, bs, D, generator=gen).to(torch.bfloat16)
    blocks = torch.randperm(NB, generator=gen)[: L // bs].unsqueeze(0)
    q = torch.randn(1, n, nh, D, generator=gen).to(torch.bfloat16)
    pos = torch.arange(start, start + n)
    bias = torch.zeros(n, L).masked_fill_(torch.arange(L).view(1, -1) > pos.view(-1, 1), -torch.inf)
    bias = _windowed(bias, pos, window).unsqueeze(0)
    sinks = torch.randn(nh, generator=gen)
    hi = pos + 1
    lo = (hi - window).clamp(min=0) if window else torch.zeros(n, dtype=torch.long)
    want = _attend(q, k_cache, v_cache, blocks, bias, D**-0.5, sinks)
    got = _attend(q, k_cache, v_cache, blocks, bias, D**-0.5, sinks, visible=(lo, hi))
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()


@pytest.mark.skipif(len(kernels.NATIVE) < 2, reason="one native path here: nothing to compare")
@pytest.mark.parametrize("L", [8, 40, 300, 1024])
def test_every_path_gives_the_avx2_bits(L):
    """The AVX-512 paths' softmax (exp and division 16 lanes at a time, the running sum kept in
    the 8-lane order) against the AVX2 one: the same bits, with sinks, windows, rows whose
    length leaves 8 values past the last 16, scores far below the max (exp flushed to 0). The
    largest case has ~3M probabilities: a last-bit change in fp32 (a sum in another order, a
    reciprocal for the division) shows in a few of their bf16 roundings."""
    from afd.kernels.attention import prefill_softmax

    gen = torch.Generator().manual_seed(L)
    n = min(L, 24) if L < 1024 else 512
    # scores far apart (most exps flushed to 0), or close (few probabilities near 0 or 1)
    s = (torch.randn(2, 4 * n, L, generator=gen) * (300 if L < 1024 else 4)).to(torch.bfloat16)
    hi = torch.arange(L - n, L) + 1
    sinks = torch.randn(8, generator=gen)
    got = {}
    for name in kernels.NATIVE:
        with paths.use(name):
            got[name] = [
                prefill_softmax(s, torch.zeros(n, dtype=torch.long), hi, 0.125, None),
                prefill_softmax(s, (hi - 5).clamp(min=0), hi, 0.125, sinks),
            ]
    base = got.pop("avx2")
    for other in got.values():
        for a, b in zip(other, base, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(scope="module")
def mla_layer(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint's first MLA layer, in bf16."""
    from afd.config import ModelConfig
    from services.attention.model import AttentionModel
    from tests.helpers.checkpoints import deepseek_v3

    path = deepseek_v3(tmp_path_factory.mktemp("ds") / "ckpt")
    cfg = ModelConfig.from_hf(path)
    return AttentionModel(cfg, torch.bfloat16, progress=False).layers[0].kind


@pytest.mark.parametrize("start", [0, 21])
def test_mla_expanded_prefill_on_the_native_softmax_matches_the_torch_path(
    mla_layer, monkeypatch, start, tile_bytes
):
    """MLA's expanded prefill (kinds/mla.py), each token's keys given to the native softmax
    by position, against the torch path's mask and softmax: a prompt alone and after a cached
    prefix of `start` tokens, on a shuffled block table. The same to bf16 rounding."""
    from services.attention.kinds import mla
    from services.attention.paged_attention import PrefillSeq

    kind, gen = mla_layer, torch.Generator().manual_seed(start)
    m, nh = kind.m, kind.cfg.num_heads
    W, bs, NB, n = m.kv_lora_rank + m.qk_rope_head_dim, 4, 24, 19
    L = -(-(start + n) // bs) * bs
    pool = torch.randn(1, NB, bs, W, generator=gen).to(torch.bfloat16)
    blocks = torch.randperm(NB, generator=gen)[: L // bs]
    pos = torch.arange(start, start + n)
    bias = torch.zeros(n, L).masked_fill_(torch.arange(L).view(1, -1) > pos.view(-1, 1), -torch.inf)
    p = PrefillSeq(0, n, blocks, start, bs)
    assert torch.equal(p.bias, bias)
    q_nope = torch.randn(n, nh, m.qk_nope_head_dim, generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(n, nh, m.qk_rope_head_dim, generator=gen).to(torch.bfloat16)
    assert mla.native_softmax(q_nope)
    got = kind.expanded(q_nope, q_pe, pool, p, pos)
    monkeypatch.setattr(mla, "native_softmax", lambda q: False)
    want = kind.expanded(q_nope, q_pe, pool, p, pos)
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()


def test_mla_absorbed_prefill_takes_the_native_softmax(mla_layer, monkeypatch, tile_bytes):
    """The absorbed form's prefill (MLA's latent, V its leading columns) goes through the
    native softmax too, and matches the torch path's to bf16 rounding."""
    from services.attention import paged_attention as pa

    kind, gen = mla_layer, torch.Generator().manual_seed(3)
    m, nh = kind.m, kind.cfg.num_heads
    r, W, bs, NB, n, start = m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim, 4, 16, 9, 14
    L = -(-(start + n) // bs) * bs
    cache = torch.randn(1, NB, bs, W, generator=gen).to(torch.bfloat16)
    blocks = torch.randperm(NB, generator=gen)[: L // bs]
    pos = torch.arange(start, start + n)
    meta = pa.AttnMeta(pos, pos, 0, None, (pa.PrefillSeq(0, n, blocks, start, bs),), block_size=bs)
    q = torch.randn(n, nh, W, generator=gen).to(torch.bfloat16)
    calls = []
    real = pa.prefill_softmax
    monkeypatch.setattr(pa, "prefill_softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = pa.paged_attention(q, cache, cache[..., :r], meta, 0.1)
    assert calls, "the latent's prefill took the torch softmax"
    monkeypatch.setattr(pa, "native_softmax", lambda q: False)
    want = pa.paged_attention(q, cache, cache[..., :r], meta, 0.1)
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()


@pytest.mark.parametrize("window", [0, 3, 40])
@pytest.mark.parametrize("budget", [1, 700, 4096, 1 << 20])
def test_the_tiles_cover_every_visible_key_within_the_budget(monkeypatch, window, budget):
    """causal_tiles: the rows in order, each once; each tile's keys hold every key its rows
    see; no tile over the budget unless it is one row; every key from 0 where a row sees key
    0 (a prefix would be copied), no keys before a windowed tile's first row's first."""
    from services.attention import paged_attention as pa

    monkeypatch.setattr(pa, "_TILE_BYTES", budget)
    n, start, row_bytes = 50, 30, 8
    hi = torch.arange(start, start + n) + 1
    lo = (hi - window).clamp(min=0) if window else torch.zeros(n, dtype=torch.long)
    L = start + n + 6  # the gathered blocks run past the last row's keys
    tiles = pa.causal_tiles(lo, hi, L, row_bytes)
    assert [r for i, _ in tiles for r in range(i.start, i.stop)] == list(range(n))
    for i, keys in tiles:
        rows = i.stop - i.start
        assert keys.start <= int(lo[i].min()) and int(hi[i].max()) <= keys.stop <= L
        assert rows == 1 or rows * (keys.stop - keys.start) * row_bytes <= budget
        assert keys == slice(0, L) if int(lo[i.start]) == 0 else keys.start == int(lo[i.start])
    if budget == 1 << 20:
        assert len(tiles) == 1


def test_the_tile_buffer_serves_in_and_out_of_inference_mode():
    """The thread's tile buffer, first made under inference mode (the engine's), is written
    again outside it (a caller's) and the other way round."""
    from services.attention import paged_attention as pa

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 8, 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 8, 16, generator=gen).to(torch.bfloat16)
    hi = torch.arange(8) + 1
    pa._tile.buf = None
    with torch.inference_mode():
        first = pa.causal_attention(q, k, k, torch.zeros_like(hi), hi, 0.25)
    again = pa.causal_attention(q, k, k, torch.zeros_like(hi), hi, 0.25)
    with torch.inference_mode():
        third = pa.causal_attention(q, k, k, torch.zeros_like(hi), hi, 0.25)
    assert torch.equal(first, again) and torch.equal(again, third)


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_bmm_into_a_buffer_gives_the_bits_of_a_fresh_result(monkeypatch, onednn_bf16):
    """afd.ops.bmm with `out` (the prefill tiles' buffer) on either route: oneDNN's bf16
    matmul, or fp32 then rounded (CPUs where oneDNN cannot pack bf16, Zen 3)."""
    from afd import ops

    monkeypatch.setattr(ops.paths, "onednn_bf16", lambda: onednn_bf16)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(3, 40, 24, generator=gen).to(torch.bfloat16)
    b = torch.randn(3, 56, 24, generator=gen).to(torch.bfloat16).transpose(1, 2)
    out = torch.full((3, 40, 56), 7.0, dtype=torch.bfloat16)
    got = ops.bmm(a, b, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out.view(torch.int16), ops.bmm(a, b).view(torch.int16))
