"""FP8 per-token codec and the tensor <-> bytes views used on the wire."""

import pytest
import torch

from afd.kernels import fp8 as fp8_kernel
from afd.kernels import paths
from afd.quant import (
    FP8,
    FP8_MAX,
    _dequantize_torch,
    _quantize_torch,
    buffer_to_tensor,
    dequantize_fp8,
    quantize_fp8,
    tensor_to_buffer,
)
from tests.helpers import kernels

# e4m3 keeps 3 mantissa bits: rounding moves a value by at most half an ulp, 2^-4 of its
# magnitude, and (relative to the row) at most 16/448 of the row's amax.
REL = 2.0**-4


def _roundtrip(x: torch.Tensor) -> torch.Tensor:
    q, scales = quantize_fp8(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (x.shape[0],)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    return dequantize_fp8(q, scales, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_error_is_bounded_per_token(dtype, magnitude):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 512, generator=g) * magnitude).to(dtype)
    xf = x.float()
    err = (_roundtrip(x) - xf).abs()  # [T, H]
    amax = xf.abs().amax(dim=1, keepdim=True)  # [T, 1]
    assert (err <= REL * amax).all()
    assert (err.amax(dim=1) <= amax[:, 0] * 16 / FP8_MAX * 1.0001).all()
    # Normal-range values are also good relative to themselves (tiny ones hit the subnormals).
    normal = xf.abs() >= amax * 2.0**-6
    assert (err[normal] <= REL * xf.abs()[normal] * 1.0001).all()


def test_row_amax_maps_to_fp8_max_without_overflow():
    x = torch.tensor([[1.0, -3.0, 2.0], [5.0, 5.0, -5.0]], dtype=torch.bfloat16)
    q, scales = quantize_fp8(x)
    qf = q.float()
    assert torch.isfinite(qf).all()
    assert qf[0, 1] == -FP8_MAX and (qf[1].abs() == FP8_MAX).all()
    assert torch.allclose(scales, torch.tensor([3.0, 5.0]) / FP8_MAX)


def test_zero_rows_stay_zero():
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[1, 4] = 2.5
    q, scales = quantize_fp8(x)
    out = dequantize_fp8(q, scales)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0], torch.zeros(16, dtype=torch.bfloat16))
    assert torch.equal(out[2], torch.zeros(16, dtype=torch.bfloat16))
    assert out[1, 4] == 2.5 and out[1].count_nonzero() == 1


@pytest.mark.parametrize("big", [6e4, 1e30, 3.0e38])
def test_extreme_magnitudes(big):
    x = torch.tensor([[big, -big / 3, 1.0], [1e-30, -2e-30, 0.0], [big, 1e-3, -0.5]])
    out = _roundtrip(x)
    assert torch.isfinite(out).all()
    amax = x.abs().amax(dim=1, keepdim=True)
    assert ((out - x).abs() <= REL * amax).all()
    assert out[0, 0] == pytest.approx(big, rel=REL)


def test_matches_torch_casts_exactly():
    # Every finite e4m3 code, against PyTorch's own (slow) cast, for small and huge scales.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = codes[(codes & 0x7F) != 0x7F].view(FP8).reshape(2, 127)
    for scales in (torch.tensor([1.0, 0.37]), torch.tensor([1e30, 2.0**-100])):
        ref = q.float() * scales[:, None]
        assert torch.equal(dequantize_fp8(q, scales, torch.float32), ref)
        assert torch.equal(dequantize_fp8(q, scales, torch.bfloat16), ref.bfloat16())
    # Quantization equals the plain formula: cast(x / (amax / 448)).
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(1)).bfloat16() * 7
    q, scales = quantize_fp8(x)
    plain = (x.float() / (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX)).to(FP8)
    assert torch.equal(q.view(torch.uint8), plain.view(torch.uint8))


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        quantize_fp8(torch.zeros(4))
    with pytest.raises(ValueError):
        dequantize_fp8(torch.zeros(2, 3).to(FP8), torch.ones(3))


@pytest.mark.parametrize(
    "dtype", [FP8, torch.bfloat16, torch.float32, torch.int32, torch.float16, torch.uint8]
)
def test_buffer_round_trip(dtype):
    x = (torch.randn(5, 7) * 10).to(dtype)
    buf = tensor_to_buffer(x)
    assert buf.nbytes == x.numel() * x.element_size()
    y = buffer_to_tensor(bytes(buf), dtype, (5, 7))
    assert y.dtype == dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def test_buffers_are_zero_copy():
    x = torch.zeros(4, 3, dtype=torch.bfloat16)
    view = tensor_to_buffer(x)
    x[1, 2] = 1.0
    assert bytes(view) == bytes(tensor_to_buffer(x))  # the view sees the change
    raw = bytearray(4 * 4)
    t = buffer_to_tensor(raw, torch.float32, (2, 2))
    raw[0:4] = torch.tensor([2.5]).numpy().tobytes()
    assert t[0, 0] == 2.5


def test_buffer_edge_cases():
    assert buffer_to_tensor(b"", torch.int32, (3, 0)).shape == (3, 0)
    assert tensor_to_buffer(torch.empty(0, 4, dtype=torch.int32)).nbytes == 0
    strided = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    assert torch.equal(buffer_to_tensor(tensor_to_buffer(strided), torch.float32, (4, 3)), strided)
    with pytest.raises(ValueError):
        buffer_to_tensor(b"\0" * 7, torch.float32, (2,))


# ------------------------------------------------------------ the native codec (fp8.c)
native = pytest.mark.skipif(not fp8_kernel.usable(torch.zeros(1, 8)), reason="kernels not built")


@native
def test_native_quantize_is_the_torch_path_bit_for_bit(native_path):
    g = torch.Generator().manual_seed(1)
    # rows from 1e-40 (subnormal scales) to 1e30, zeros, a row holding inf and one holding nan
    mags = torch.logspace(-40, 30, 60)
    x = (torch.randn(64, 256, generator=g) * torch.cat([mags, torch.ones(4)])[:, None]).bfloat16()
    x[60] = 0
    x[61, ::7] = 0
    x[62, 5] = float("inf")
    x[63, 9] = float("nan")
    q1, s1 = fp8_kernel.quantize(x)
    q2, s2 = _quantize_torch(x)
    assert torch.equal(s1[:63].view(torch.int32), s2[:63].view(torch.int32))
    assert torch.equal(q1[:63].view(torch.uint8), q2[:63].view(torch.uint8))
    # the nan row: a nan scale and nan codes both ways (nan payloads and signs may differ)
    assert s1[63].isnan() and s2[63].isnan()
    assert ((q1[63].view(torch.uint8) & 0x7F) == 0x7F).all()
    assert ((q2[63].view(torch.uint8) & 0x7F) == 0x7F).all()


@native
def test_native_dequantize_is_the_torch_path_bit_for_bit(native_path):
    # all 256 codes (NaN ones included) against scales from the clamp floor to huge ones
    codes = torch.arange(256, dtype=torch.uint8).repeat(9, 1).view(FP8)  # [9, 256]
    scales = torch.tensor([2.0**-126, 1e-30, 1e-3, 0.37, 1.0, 3.3, 127.9, 200.0, 1e30])
    a = fp8_kernel.dequantize(codes.contiguous(), scales)
    b = _dequantize_torch(codes, scales, torch.bfloat16)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@native
@pytest.mark.skipif(len(kernels.NATIVE) < 2, reason="one native path here: nothing to compare")
@pytest.mark.parametrize("H", [8, 24, 1024])
def test_native_codec_gives_the_same_bits_on_every_path(H):
    """The AVX-512 rows (16 values at a time, a last 8 on the 8-lane code) against the AVX2 ones,
    on rows from subnormal to huge, with a zero, an inf and a NaN row, enough rows to thread."""
    g = torch.Generator().manual_seed(H)
    mags = torch.logspace(-40, 30, 96)[:, None]
    x = (torch.randn(96, H, generator=g) * mags).bfloat16()
    x[0], x[1, H // 2], x[2, H - 1] = 0, float("inf"), float("nan")
    got = {}
    for name in kernels.NATIVE:
        with paths.use(name):
            q, s = fp8_kernel.quantize(x)
            got[name] = (q.view(torch.uint8), s.view(torch.int32), fp8_kernel.dequantize(q, s))
    base = got.pop("avx2")
    for q, s, y in got.values():
        assert torch.equal(q, base[0]) and torch.equal(s, base[1])
        assert torch.equal(y.view(torch.int16), base[2].view(torch.int16))
