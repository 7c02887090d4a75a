"""afd's bf16 matmuls (afd/kernels/gemm.c for AVX2, gemm512.c for AVX-512 BF16, amx.c for AMX),
each on every machine that runs it, against an fp32 matmul of the same bf16 values: every path
of the kernels (1 and 2 rows of x, chunks of up to 6 rows, the AVX2 fp32-tile path from 13 rows
with its 2-row blocks and the odd last row, weight rows not a multiple of 4, K not a multiple of
32; AMX's one and two blocks of 16 rows of x, a last block of 16 weight rows alone and the
weight rows past the last whole tile; one and two threads); and ops.Linear on every kernel path
(AFD_KERNELS)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from afd.kernels import gemm, paths
from afd.ops import Linear
from tests.helpers import kernels


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 12, 13, 14, 33, 70])
@pytest.mark.parametrize("n,k", [(13, 24), (256, 512), (1030, 1000), (1046, 64), (1040, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_fp32_matmul_to_bf16_rounding(native_path, m, n, k, threads):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = gemm.bf16_linear(x, gemm.lay_out(w, native_path.matmul), native_path.matmul)
    finally:
        torch.set_num_threads(before)
    ref = F.linear(x.float(), w.float())  # exact products, fp32 sums
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # one bf16 rounding of the result, plus fp32 summation-order noise
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-4 * k**0.5)
    # and it is the bf16 rounding of (almost) the same fp32 value almost everywhere
    assert (y == ref.to(torch.bfloat16)).float().mean() > 0.99


@pytest.mark.parametrize("m", [1, 4, 8, 13])
def test_results_halfway_between_two_bf16_values_round_to_the_even_one(native_path, m):
    """Each output is exactly halfway between two bf16 values (1 + j/128 + 1/256 and its
    negative, sums exact in fp32): every path rounds it to the even one, as torch does, in its
    one-row and batched stores alike; an infinite sum stays infinite, inf - inf is a NaN."""
    n, k = 16, 64
    j = torch.arange(n, dtype=torch.float32) % 8
    w = torch.zeros(n, k)
    w[:, 0] = (1 + j / 128) * torch.where(torch.arange(n) < 8, 1.0, -1.0)
    w[:, 1] = 2.0**-8 * torch.where(torch.arange(n) < 8, 1.0, -1.0)
    x = torch.zeros(m, k)
    x[:, :2] = 1.0
    w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    y = gemm.bf16_linear(x, gemm.lay_out(w, native_path.matmul), native_path.matmul)
    ref = F.linear(x.float(), w.float()).to(torch.bfloat16)
    assert torch.equal(y, ref)
    assert not torch.equal(ref[0, :8].float(), 1 + j[:8] / 128 + 1 / 128)  # not all rounded up
    w[0, 2], w[1, 2], w[1, 3] = float("inf"), float("inf"), float("-inf")
    x[:, 2:4] = 1.0
    y = gemm.bf16_linear(x, gemm.lay_out(w, native_path.matmul), native_path.matmul)
    assert torch.isinf(y[:, 0]).all() and torch.isnan(y[:, 1]).all()


@pytest.mark.parametrize("n", [4, 13, 1030])
def test_pack_lays_each_group_of_4_rows_out_as_one_run(n):
    w = torch.arange(n * 16, dtype=torch.float32).reshape(n, 16).to(torch.bfloat16)
    p = gemm.pack(w)
    assert p.shape == w.shape and p.is_contiguous()
    g = n // 4
    # group i, run s: rows 4i..4i+3, values 8s..8s+7 each
    assert torch.equal(
        p[: 4 * g].reshape(g, 2, 4, 8), w[: 4 * g].reshape(g, 4, 2, 8).transpose(1, 2)
    )
    assert torch.equal(p[4 * g :], w[4 * g :])  # the rows after the last group as they were


@pytest.mark.parametrize("n,k", [(32, 64), (48, 96), (24, 64), (32, 48)])
def test_pack_tiles_lays_each_tile_out_as_one_run(n, k):
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    p = gemm.pack_tiles(w)
    assert p.shape == w.shape and p.is_contiguous()
    if n % 16 or k % 32:  # no whole tiles: row-major
        assert torch.equal(p, w)
        return
    # tile (group g, step s): rows 16g..16g+15, values 32s..32s+31, row by row, one run of 512
    runs = p.reshape(-1, 512)
    for g in range(n // 16):
        for s in range(k // 32):
            tile = w[16 * g : 16 * g + 16, 32 * s : 32 * s + 32].reshape(-1)
            assert torch.equal(runs[g * (k // 32) + s], tile), (g, s)


@pytest.mark.parametrize("cancelling", [False, True], ids=["randn", "cancelling"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_the_batch_it_is_in(native_path, threads, cancelling):
    """Every path (1, 2, pairs or chunks, fp32 tile, tail rows) sums a row's products in the
    same order, so a token gets the same bits at batch 1 as inside a batch of 70."""
    isa = native_path.matmul
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1030, 256, generator=g)
    x = torch.randn(70, 256, generator=g)
    if cancelling:
        # per weight row 2^24 forty times, -2^24 forty times and +-1 elsewhere, at random places,
        # against a row of ones: the exact sum is small, and how many of the ones a partial sum
        # of 2^24 swallows (2^24 + 1 is not an fp32) depends on the order of every add, so a
        # change of order anywhere shows in the (small, exactly representable) result
        sign = torch.randint(0, 2, (1030, 256), generator=g) * 2.0 - 1
        big = torch.rand(1030, 256, generator=g).argsort(dim=1)[:, :80]
        w = sign.scatter(1, big, torch.full((1030, 80), 2.0**24))
        w.scatter_(1, big[:, 40:], -(2.0**24))
        x = torch.ones(70, 256)
    w, x = gemm.lay_out(w.to(torch.bfloat16), isa), x.to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = gemm.bf16_linear(x[:1], w, isa)
        for m in (2, 3, 7, 12, 13, 33, 70):
            y = gemm.bf16_linear(x[:m], w, isa)
            assert torch.equal(y[:1], alone), m
            if cancelling:
                assert torch.equal(y, alone.expand(m, -1)), m
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 33, 70])
def test_every_batch_size_adds_a_rows_products_in_k_order(native_path, m):
    """The path a batch takes depends on its rows (one weight row at a time for a few rows of
    x, groups of four weight rows for more, fp32 tiles), and every path adds a lane's products
    in the order of k: 2^24 + 1 - 2^24 is 0 in fp32 that way and 1 the other way round."""
    isa = native_path.matmul
    k = 96
    w = torch.zeros(8, k)
    x = torch.zeros(m, k)
    x[:, 0], w[0, 0] = 2.0**12, 2.0**12
    x[:, 32], w[0, 32] = 1.0, 1.0
    x[:, 64], w[0, 64] = 2.0**12, -(2.0**12)
    w[1:] = torch.randn(7, k)
    y = gemm.bf16_linear(x.to(torch.bfloat16), gemm.lay_out(w.to(torch.bfloat16), isa), isa)
    assert torch.equal(y[:, 0].float(), torch.zeros(m))


def test_leading_dims_and_non_contiguous_input(native_path):
    isa = native_path.matmul
    w = torch.randn(64, 32).to(torch.bfloat16)
    x = torch.randn(32, 3, 5).to(torch.bfloat16).permute(1, 2, 0)  # [3, 5, 32], strided
    y = gemm.bf16_linear(x, gemm.lay_out(w, isa), isa)
    assert y.shape == (3, 5, 64)
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("m", [1, 5, 9, 40])
def test_linear_computes_the_linear_on_every_kernel_path(kernel_path, m):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
    lin = Linear(w)
    assert lin.matmul == kernel_path.matmul
    ref = F.linear(x, w)
    if kernel_path.matmul in ("onednn", "torch"):  # F.linear's bits exactly
        assert torch.equal(lin(x), ref)
    else:  # afd's kernel (or oneDNN's from onednn_from rows): fp32 sums, rounded once
        torch.testing.assert_close(
            lin(x).float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-3
        )
    assert Linear(torch.randn(16, 32)).native is False  # fp32 weights: torch's matmul


def test_a_weight_afds_kernels_cannot_take_goes_to_torch():
    if "avx2" in paths.runnable():
        with paths.use("avx2"):
            assert Linear(torch.randn(16, 12).to(torch.bfloat16)).native is False  # K % 8
    if "avx512bf16" in paths.runnable():
        with paths.use("avx512bf16"):
            assert Linear(torch.randn(16, 12).to(torch.bfloat16)).native  # any even K
            assert Linear(torch.randn(16, 13).to(torch.bfloat16)).native is False


def test_avx512_hands_larger_batches_to_onednn_from_the_crossover(monkeypatch):
    """ops.Linear takes afd's kernel below AFD_ONEDNN_FROM_ROWS rows of x, oneDNN's from there
    (F.linear's bits exactly), and the fused calls follow the same rule."""
    if "avx512bf16" not in paths.runnable() or not paths.onednn_bf16():
        pytest.skip("needs AVX-512 BF16 and oneDNN's bf16 matmul")
    monkeypatch.setenv("AFD_ONEDNN_FROM_ROWS", "4")
    with paths.use("avx512bf16"):
        g = torch.Generator().manual_seed(1)
        w = torch.randn(64, 256, generator=g).to(torch.bfloat16)
        lin = Linear(w)
        assert lin.onednn_from == 4
        x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, w))
        assert torch.equal(lin(x[:3]), gemm.bf16_linear(x[:3], w, "avx512bf16"))
    monkeypatch.setenv("AFD_ONEDNN_FROM_ROWS", "0")
    assert paths.onednn_from_rows(2) == paths.NEVER
    monkeypatch.setenv("AFD_ONEDNN_FROM_ROWS", "lots")
    with pytest.raises(paths.ConfigError, match="AFD_ONEDNN_FROM_ROWS"):
        paths.onednn_from_rows(2)


@pytest.mark.parametrize("tokens", [1, 4, 37, 200])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_experts_match_the_torch_path_bit_for_bit(native_path, tokens, threads):
    """services/ffn/experts.py's fused native call against its per-expert torch path: the same
    rounding steps, so the same bits (experts 4..11 held here; ids 0..15 routed)."""
    from services.ffn.experts import ExpertGroup, routed_experts

    g = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, k = 256, 128, 8, 3

    def lin(n, m):
        return Linear((torch.randn(n, m, generator=g) * 0.05).to(torch.bfloat16))

    w13 = [lin(2 * inter, hidden) for _ in range(experts)]
    w2 = [lin(hidden, inter) for _ in range(experts)]
    assert w13[0].isa == native_path.matmul
    fused, plain = ExpertGroup.build(4, w13, w2), ExpertGroup(4, w13, w2)
    assert fused.native is not None and plain.native is None
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 16, (tokens, k), generator=g, dtype=torch.int32)
    weights = torch.rand(tokens, k, generator=g)
    out = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    a, a2, b = out.clone(), out.clone(), out.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        routed_experts(x, ids, weights, fused, a)
        routed_experts(x, ids, weights, fused, a2)  # successive calls visit experts reversed
    finally:
        torch.set_num_threads(before)
    routed_experts(x, ids, weights, plain, b)
    assert not torch.equal(a, out)  # it did add something
    assert torch.equal(a, b) and torch.equal(a2, b)


needs_library = pytest.mark.skipif(
    not gemm.available(), reason="kernels not built or the CPU lacks AVX2/FMA"
)


@needs_library
@pytest.mark.parametrize(
    "kvh,g,d,lens,num_blocks",
    [
        (4, 4, 64, [1, 17, 96, 50, 33], 40),
        (1, 8, 256, [1, 17, 96, 50, 33], 40),
        (2, 1, 128, [1, 17, 96, 50, 33], 40),
        # long rows: the softmax's max in lanes past 32 positions, V fetched ahead past 16
        (4, 4, 64, [1000, 257, 32, 65], 260),
        # 6 query heads a K/V head (two passes of the AVX-512 values, 4 heads then 2); a head
        # dimension that is no multiple of 32 (the AVX2 products on every path)
        (2, 6, 96, [1, 18, 47], 12),
        (2, 3, 40, [1, 18, 47], 12),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window,sinks", [(0, False), (24, True)], ids=["plain", "sinks-window"])
def test_decode_attention_matches_the_torch_path(
    kvh, g, d, lens, num_blocks, threads, window, sinks, native_path
):
    """The native paged decode attention against services/attention's torch path (gathered
    blocks, bmm with bf16 rounding, fp32 softmax) on a shuffled block table: the same to
    bf16 rounding, and the same bits almost everywhere; also with gpt-oss's sink logits and a
    sliding window shorter than most rows. On each native path: AVX-512 BF16's products where
    the path has them (attention512.c), AVX2's otherwise."""
    from afd.kernels.attention import decode_attention
    from services.attention.paged_attention import _attend, _windowed

    gen = torch.Generator().manual_seed(kvh * 100 + g)
    bs = 16
    nb = -(-max(lens) // bs)
    lens = torch.tensor(lens)
    k_cache = torch.randn(kvh, num_blocks, bs, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(kvh, num_blocks, bs, d, generator=gen).to(torch.bfloat16)
    blocks = torch.randperm(num_blocks, generator=gen)[: len(lens) * nb].view(len(lens), nb)
    q = torch.randn(len(lens), kvh * g, d, generator=gen).to(torch.bfloat16)
    bias = torch.full((len(lens), 1, nb * bs), float("-inf"))
    for i, n in enumerate(lens.tolist()):
        bias[i, :, :n] = 0.0
    bias = _windowed(bias, lens - 1, window)
    sink = torch.randn(kvh * g, generator=gen) * 2 if sinks else None
    scale = d**-0.5
    ref = _attend(q.unsqueeze(1), k_cache, v_cache, blocks, bias, scale, sink)
    ref = ref.reshape(len(lens), -1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decode_attention(q, k_cache, v_cache, blocks, lens, scale, sink, window)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-9)
    assert (out == ref).float().mean() > 0.98


@needs_library
@pytest.mark.parametrize(
    "d,dv,nh",
    [(288, 256, 16), (576, 512, 72), (72, 64, 16), (96, 40, 16)],
    ids=["wide", "wide-72-heads", "avx2", "mixed"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_reads_mla_values_from_the_latent(d, dv, nh, threads, native_path):
    """MLA's decode: one K/V head (the latent and its rotary part, D wide), nh query heads, V
    the latent's first Dv columns of the same rows (a view of K); against the torch path, which
    gathers K once and takes V from it. One sequence on two threads splits its query heads
    between two tasks, three sequences do not: each sequence alone gives the batch's bits (a
    head's arithmetic does not depend on its group). D and Dv multiples of 32 take AVX-512
    BF16's products where the path has them, the others AVX2's; "mixed": the scores on one and
    the values on the other. On AMX the scores take the tiles, 16 heads a tile and up to 4
    tiles at once (72 heads: 5 tiles, the last one half full)."""
    from afd.kernels.attention import decode_attention
    from services.attention.paged_attention import _attend

    gen = torch.Generator().manual_seed(d + dv)
    bs, lens = 16, torch.tensor([300, 1, 47])
    nb = -(-int(lens.max()) // bs)
    k_cache = torch.randn(1, 70, bs, d, generator=gen).to(torch.bfloat16)
    v_cache = k_cache[..., :dv]
    blocks = torch.randperm(70, generator=gen)[: len(lens) * nb].view(len(lens), nb)
    q = torch.randn(len(lens), nh, d, generator=gen).to(torch.bfloat16)
    bias = torch.full((len(lens), 1, nb * bs), float("-inf"))
    for i, n in enumerate(lens.tolist()):
        bias[i, :, :n] = 0.0
    scale = d**-0.5
    ref = _attend(q.unsqueeze(1), k_cache, v_cache, blocks, bias, scale).reshape(len(lens), -1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = decode_attention(q, k_cache, v_cache, blocks, lens, scale)
        alone = [decode_attention(q[i : i + 1], k_cache, v_cache, blocks[i : i + 1],
                                  lens[i : i + 1], scale) for i in range(len(lens))]  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert out.shape == (len(lens), nh * dv)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-9)
    assert (out == ref).float().mean() > 0.98
    assert torch.equal(out.view(torch.int16), torch.cat(alone).view(torch.int16))


@needs_library
@pytest.mark.parametrize(
    "kvh,nh,d,dv,window,sinks",
    [(1, 16, 576, 512, 0, False), (2, 16, 64, 64, 1500, True)],
    ids=["mla", "gqa-window-sinks"],
)
def test_decode_attention_over_long_rows_is_the_same_on_any_schedule(
    kvh, nh, d, dv, window, sinks, native_path
):
    """Rows longer than a chunk of positions (on AMX from 8 query heads a K/V head: 1,024, a
    row's softmax sum and its values summed a chunk at a time and the chunks then added in
    order): against torch's path within bf16's tolerance, and each sequence alone (a single
    (sequence, K/V head) pair: the work split by chunk, and by query heads where chunks are
    fewer than threads) gives the batch's bits (a task for every pair, its chunks in turn), on
    1, 2 and 3 threads (3: two K/V heads alone split too). Lengths on both sides of a chunk's
    end; a window that starts mid-row."""
    from afd.kernels.attention import decode_attention
    from services.attention.paged_attention import _attend

    gen = torch.Generator().manual_seed(nh + d)
    bs, lens = 16, torch.tensor([2600, 1, 1030, 1024, 1025])
    nb = -(-int(lens.max()) // bs)
    pool = len(lens) * nb + 3
    k_cache = torch.randn(kvh, pool, bs, d, generator=gen).to(torch.bfloat16)
    v_cache = (
        k_cache[..., :dv] if dv < d else torch.randn(kvh, pool, bs, d, generator=gen).bfloat16()
    )
    blocks = torch.randperm(pool, generator=gen)[: len(lens) * nb].view(len(lens), nb)
    q = torch.randn(len(lens), nh, d, generator=gen).to(torch.bfloat16)
    sink = torch.randn(nh, generator=gen) if sinks else None
    bias = torch.full((len(lens), 1, nb * bs), float("-inf"))
    for i, n in enumerate(lens.tolist()):
        bias[i, :, max(0, n - window) if window else 0 : n] = 0.0
    scale = d**-0.5
    ref = _attend(q.unsqueeze(1), k_cache, v_cache, blocks, bias, scale, sink)
    ref = ref.reshape(len(lens), -1)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = decode_attention(q, k_cache, v_cache, blocks, lens, scale, sink, window)
            alone = [decode_attention(q[i : i + 1], k_cache, v_cache, blocks[i : i + 1],
                                      lens[i : i + 1], scale, sink, window)
                     for i in range(len(lens))]  # fmt: skip
            torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-9)
            assert (out == ref).float().mean() > 0.98
            assert torch.equal(out.view(torch.int16), torch.cat(alone).view(torch.int16))
    finally:
        torch.set_num_threads(before)


@needs_library
def test_mla_decode_takes_the_native_kernel_up_to_its_head_count(native_path, monkeypatch):
    """paged_attention on MLA's cache (V a view of K's leading columns): up to latent_heads()
    query heads a K/V head the decode calls the native kernel (on amx at any count); past it,
    torch's gathered batched matmuls (the same bits as _attend). The two mostly agree to the
    bit, so the calls are what is checked."""
    from services.attention import paged_attention as pa

    calls, real = [], pa.decode_attention

    def native(*args, **kwargs):
        calls.append(args[0].shape[1])  # q [B, nh, D]: its heads
        return real(*args, **kwargs)

    monkeypatch.setattr(pa, "decode_attention", native)
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(1, 8, 16, 72, generator=gen).to(torch.bfloat16)
    v_cache = k_cache[..., :64]
    blocks, lens = torch.tensor([[3, 1, 6]]), torch.tensor([40])
    meta = pa.AttnMeta(positions=lens - 1, slots=lens - 1, num_decode=1, decode_blocks=blocks,
                       prefills=(), decode_lens=lens, block_size=16)  # fmt: skip
    limit = pa.latent_heads()
    if limit is None:  # amx: every head count, DeepSeek-V3's 128 and more
        for nh in (16, 128, 256):
            pa.paged_attention(torch.randn(1, nh, 72, generator=gen).bfloat16(), k_cache,
                               v_cache, meta, 0.1)  # fmt: skip
        assert calls == [16, 128, 256]
        return
    for nh in (limit, limit + 4):
        q = torch.randn(1, nh, 72, generator=gen).to(torch.bfloat16)
        got = pa.paged_attention(q, k_cache, v_cache, meta, 0.1)
        if nh > limit:
            want = pa._attend(q.unsqueeze(1), k_cache, v_cache, blocks, meta.decode_bias, 0.1)
            assert torch.equal(got.view(torch.int16), want.reshape(1, -1).view(torch.int16))
    assert calls == [limit]


def test_decode_attention_refuses_a_v_that_is_not_k_s_leading_columns():
    from afd.kernels.attention import decode_attention

    k = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    v = torch.zeros(1, 2, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="leading columns"):
        decode_attention(torch.zeros(1, 1, 64, dtype=torch.bfloat16), k, v,
                         torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]), 1.0)  # fmt: skip


@needs_library
@pytest.mark.skipif(len(kernels.NATIVE) < 2, reason="one native path here: nothing to compare")
def test_decode_attention_softmax_is_the_same_bits_on_every_path():
    """Where D % 32 != 0 both paths take the AVX2 products, so only the softmax differs in how
    it runs (16 lanes on AVX-512): the outputs are the same bits, lengths 1 to 77 (rows past
    the last 16 by 8 and by less), sinks and a window included."""
    from afd.kernels.attention import decode_attention

    gen = torch.Generator().manual_seed(3)
    lens = torch.tensor([1, 9, 24, 40, 77])
    k_cache, v_cache = (torch.randn(2, 40, 16, 40, generator=gen).bfloat16() for _ in range(2))
    blocks = torch.randperm(40, generator=gen)[:25].view(5, 5)
    q = torch.randn(5, 6, 40, generator=gen).bfloat16()
    sink = torch.randn(6, generator=gen)
    got = {}
    for name in kernels.NATIVE:
        with paths.use(name):
            got[name] = [
                decode_attention(q, k_cache, v_cache, blocks, lens, 0.2, None, 0),
                decode_attention(q, k_cache, v_cache, blocks, lens, 0.2, sink, 30),
            ]
    base = got.pop("avx2")
    for other in got.values():
        for a, b in zip(other, base, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@needs_library
def test_decode_attention_rejects_a_length_past_the_block_table():
    from afd.kernels.attention import decode_attention

    cache = torch.zeros(1, 4, 16, 8, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="lengths"):
        decode_attention(
            q, cache, cache, torch.zeros(1, 2, dtype=torch.long), torch.tensor([33]), 1.0
        )
