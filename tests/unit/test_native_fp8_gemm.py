"""fp8_gemm.c: a block-FP8 weight multiplied in one native call gives, on every afd kernel
path, the bits of the same path's matmul on the dense bf16 weight (BlockFP8.dequantize's
numbers): at every row count of x, ragged K-blocks, row counts off the layouts' groups,
subnormal codes and scales small enough that the products are fp32 subnormals."""

from __future__ import annotations

import pytest
import torch

from afd.blockfp8 import FP8, BlockFP8, quantize_blocks
from afd.kernels import fp8_gemm, gemm
from afd.ops import Linear

pytestmark = pytest.mark.skipif(not gemm.available(), reason="native kernels not built")


def _weight(n: int, k: int, block: tuple[int, int], seed: int, tiny: bool = False) -> BlockFP8:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, :5] *= 1e-4  # codes near zero: e4m3's subnormals
    q, scale = quantize_blocks(w, block)
    if tiny:  # products below fp32's smallest normal: rounded as subnormals, never flushed
        scale = scale * 2.0**-125
    return BlockFP8.from_checkpoint(q, scale, block)


def _dense_on(x: torch.Tensor, w: BlockFP8, isa: str) -> torch.Tensor:
    return gemm.bf16_linear(x, gemm.lay_out(w.dequantize(torch.bfloat16), isa), isa)


SHAPES = [  # (N, K, block): whole and ragged K-blocks, N off the 4- and 16-row groups
    (64, 64, (32, 48)),
    (70, 96, (128, 128)),
    (200, 128, (16, 40)),
    (96, 1024, (128, 128)),
    (130, 320, (64, 24)),
    (75, 192, (3, 32)),  # K-blocks of 32 only; blocks of 3 rows split the streamed row pairs
    (66, 256, (16, 96)),  # K-blocks of 96: 64 codes a step and a last 32
]


@pytest.mark.parametrize("n,k,block", SHAPES)
def test_fp8_gemm_is_the_dense_weights_matmul(native_path, n, k, block):
    isa = native_path.matmul
    w = _weight(n, k, block, seed=n + k)
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 7, 13, 32, 40):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        got = fp8_gemm.linear(x, w, isa)
        want = _dense_on(x, w, isa)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (isa, n, k, m)


def test_subnormal_products_are_not_flushed(native_path):
    isa = native_path.matmul
    w = _weight(64, 128, (32, 32), seed=3, tiny=True)
    dense = w.dequantize(torch.bfloat16)
    assert (dense != 0).any() and (dense.float().abs() < 2.0**-126).any()
    x = torch.ones(2, 128, dtype=torch.bfloat16) * 2.0**100
    got, want = fp8_gemm.linear(x, w, isa), _dense_on(x, w, isa)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_each_block_takes_its_own_scale_where_weights_are_looked_up(native_path):
    """AVX-512 VBMI looks a fast block's weights up in a table built per scale and shared by
    rows of one scale: blocks with a subnormal scale (converted instead) among fast ones, and
    equal scales in other row blocks, give the dense weight's bits at every decode row count."""
    isa = native_path.matmul
    w = _weight(37, 384, (5, 64), seed=11)
    scale = w.scale.clone()  # [N, nK]: each row's blocks
    scale[:, 1::3] *= 2.0**-125  # every third K-block's products subnormal
    scale[20:25] = scale[0:5]  # a later row block with the first one's scales
    w = BlockFP8(w.q, scale.contiguous(), w.block_k)
    g = torch.Generator().manual_seed(2)
    for m in range(1, 8):
        x = torch.randn(m, 384, generator=g).to(torch.bfloat16) * 2.0**60
        got, want = fp8_gemm.linear(x, w, isa), _dense_on(x, w, isa)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (isa, m)


def test_threads_split_rows_without_changing_bits(native_path):
    isa = native_path.matmul
    w = _weight(1024, 256, (128, 128), seed=4)  # past the one-thread threshold
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fp8_gemm.linear(x, w, isa)
        torch.set_num_threads(2)
        two = fp8_gemm.linear(x, w, isa)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))
    assert torch.equal(one.view(torch.int16), _dense_on(x, w, isa).view(torch.int16))


def test_linear_takes_the_native_call_and_keeps_the_weight_fp8(native_path, monkeypatch):
    w = _weight(128, 256, (128, 128), seed=6)
    lin = Linear(w)
    calls = []
    real = fp8_gemm.linear
    monkeypatch.setattr(fp8_gemm, "linear", lambda *a: calls.append(a[2]) or real(*a))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    y = lin(x)
    assert calls == [native_path.matmul]
    assert isinstance(lin.w, BlockFP8) and lin.w.q.dtype == FP8
    dense = Linear(w.dequantize(torch.bfloat16))
    assert torch.equal(y.view(torch.int16), dense(x).view(torch.int16))


def test_a_planted_scale_off_by_one_block_is_caught(native_path):
    """The scales read one K-block late: the comparison above would see it."""
    isa = native_path.matmul
    w = _weight(64, 256, (32, 64), seed=8)
    shifted = BlockFP8(w.q, torch.roll(w.scale, 1, dims=1).contiguous(), w.block_k)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert not torch.equal(fp8_gemm.linear(x, shifted, isa), _dense_on(x, w, isa))


def _experts(E: int, H: int, inter: int, block, seed: int):
    w13 = [_weight(2 * inter, H, block, seed + e) for e in range(E)]
    w2 = [_weight(H, inter, block, seed + 100 + e) for e in range(E)]
    return w13, w2


# the intermediate width a multiple of 32 (both matrices on AMX tiles), then not (w2 row-major);
# K-blocks of 48, then of 32 (AVX-512 VBMI's tables: the threads' caches in the fused call)
@pytest.mark.parametrize(
    "H,inter,block", [(128, 96, (32, 48)), (64, 40, (32, 48)), (128, 96, (16, 32))]
)
def test_fused_fp8_experts_are_the_dense_experts(native_path, H, inter, block):
    from afd.kernels.moe import NativeExperts

    E, k = 6, 2
    w13, w2 = _experts(E, H, inter, block, seed=10)
    fp8 = NativeExperts([Linear(w).w for w in w13], [Linear(w).w for w in w2], native_path.matmul)
    dense = NativeExperts(
        [Linear(w.dequantize(torch.bfloat16)).w for w in w13],
        [Linear(w.dequantize(torch.bfloat16)).w for w in w2],
        native_path.matmul,
    )
    assert fp8.block_k == block[1] and isinstance(fp8.w13[0], BlockFP8)
    g = torch.Generator().manual_seed(11)
    for T in (1, 5, 32):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, E + 2, (T, k), generator=g)  # ids past E: another shard's
        wts = torch.rand(T, k, generator=g)
        got, want = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, H, dtype=torch.bfloat16)
        fp8(x, ids, wts, 0, got)
        dense(x, ids, wts, 0, want)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (T, H, inter)


def test_an_fp8_expert_group_takes_the_fused_call(native_path, monkeypatch):
    from afd.kernels.moe import NativeExperts
    from services.ffn.experts import ExpertGroup, routed_experts

    w13, w2 = _experts(4, 64, 32, (128, 128), seed=20)
    group = ExpertGroup.build(0, [Linear(w) for w in w13], [Linear(w) for w in w2])
    assert group.native is not None and group.native.block_k == 128
    calls = []
    real = NativeExperts.__call__
    monkeypatch.setattr(NativeExperts, "__call__", lambda s, *a: calls.append(1) or real(s, *a))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(21)).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    out = routed_experts(x, ids, torch.rand(3, 2), group, torch.zeros(3, 64, dtype=torch.bfloat16))
    assert calls == [1] and out.abs().sum() > 0
