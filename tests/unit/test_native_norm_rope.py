"""afd's native RMSNorm and RoPE (afd/kernels/norm_rope.c) against the torch code they replace:
RoPE bit for bit; RMSNorm up to the fp32 summation order of its statistic. Each on every native
path this machine runs; the AVX-512 rows give the AVX2 rows' bits."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import gemm, norm_rope, paths
from services.attention.rope import Rope
from tests.helpers import kernels

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)


def _torch_rms_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@pytest.mark.parametrize(
    "shape", [(1, 1024), (33, 1024), (5, 7, 64), (3, 256), (2, 3, 4, 8), (3, 40)]
)
def test_rms_norm_matches_torch(shape, native_path):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    w = (torch.randn(shape[-1], generator=g)).to(torch.bfloat16)
    y = norm_rope.rms_norm(x, w, 1e-6)
    ref = _torch_rms_norm(x, w, 1e-6)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16 and y.is_contiguous()
    # at most one bf16 ulp apart, and identical almost everywhere
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=0)
    assert (y == ref).float().mean() > 0.99


def test_rms_norm_reads_strided_heads_in_place(native_path):
    """q and k are views into the fused qkv projection: [T, heads, D] with a token stride (q
    here enough rows to be split between threads, k not)."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(40, (16 + 2 * 4) * 64, generator=g).to(torch.bfloat16)
    q = qkv[:, : 16 * 64].view(40, 16, 64)
    k = qkv[:, 16 * 64 : 20 * 64].view(40, 4, 64)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    for view in (q, k):
        assert not view.is_contiguous()
        y = norm_rope.rms_norm(view, w, 1e-6)
        ref = _torch_rms_norm(view.contiguous(), w, 1e-6)
        torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=0)


def test_rms_norm_keeps_nan(native_path):
    x = torch.ones(2, 24, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    y = norm_rope.rms_norm(x, torch.ones(24, dtype=torch.bfloat16), 1e-6)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[0]).any()


# (T = 33: a batch's rows, split between threads; the others serial)
@pytest.mark.parametrize(
    "heads,d,T", [(16, 64, 9), (1, 256, 9), (4, 128, 9), (2, 16, 9), (16, 64, 33), (3, 48, 5)]
)
def test_rope_is_bit_identical_to_torch(heads, d, T, native_path):
    g = torch.Generator().manual_seed(heads * d + T)
    rope = Rope(d, 10000.0, 512)
    q = (torch.randn(T, heads, d, generator=g) * 2).to(torch.bfloat16)
    pos = torch.randint(0, 512, (T,), generator=g)
    cos, sin = rope.tables(torch.bfloat16)
    got = norm_rope.rope(q, cos, sin, pos)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    half = d // 2
    ref = q * c + torch.cat([-q[..., half:], q[..., :half]], dim=-1) * s
    assert torch.equal(got, ref)


def test_rope_reads_a_strided_view(native_path):
    g = torch.Generator().manual_seed(2)
    rope = Rope(64, 10000.0, 64)
    base = torch.randn(5, 3 * 64 + 64, generator=g).to(torch.bfloat16)
    k = base[:, :192].view(5, 3, 64)  # token stride 256, not 192
    pos = torch.arange(5)
    cos, sin = rope.tables(torch.bfloat16)
    assert torch.equal(
        norm_rope.rope(k, cos, sin, pos), norm_rope.rope(k.contiguous(), cos, sin, pos)
    )


@pytest.mark.skipif(len(kernels.NATIVE) < 2, reason="one native path here: nothing to compare")
@pytest.mark.parametrize("d,rope_d", [(8, 16), (24, 48), (64, 64), (1032, 208)])
def test_every_path_gives_the_avx2_bits(d, rope_d):
    """The AVX-512 rows (16 lanes, a last 8 values on 8) sum the squares in the AVX2 rows'
    lanes and order: the same bits, not merely close ones (rows wide and narrow, tiny and huge
    values, rows split between threads)."""
    g = torch.Generator().manual_seed(d)
    # rows tiny to huge, and enough ordinary ones (~8M values at the widest) that a last-bit
    # change of a row's statistic (another order of its sum) shows in some bf16 roundings
    rows = 64 + (1 << 23) // d
    scale = torch.cat([torch.logspace(-30, 30, 64), torch.logspace(-3, 3, rows - 64)])[:, None]
    x = (torch.randn(rows, d, generator=g) * scale).to(torch.bfloat16)
    w = torch.randn(d, generator=g).to(torch.bfloat16)
    rope = Rope(rope_d, 10000.0, 4096)
    cos, sin = rope.tables(torch.bfloat16)
    q = (torch.randn(300, 4, rope_d, generator=g) * 4).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (300,), generator=g)
    results = {}
    for name in kernels.NATIVE:
        with paths.use(name):
            results[name] = (norm_rope.rms_norm(x, w, 1e-6), norm_rope.rope(q, cos, sin, pos))
    base = results.pop("avx2")
    for got in results.values():
        assert torch.equal(got[0].view(torch.int16), base[0].view(torch.int16))
        assert torch.equal(got[1].view(torch.int16), base[1].view(torch.int16))
