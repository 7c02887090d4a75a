"""Number formats on the wire: the FP8 per-token codec and tensor <-> bytes views.

FP8 (A2F): each token (row) of the hidden states is scaled so that its largest magnitude maps to
448, the largest finite float8_e4m3fn, and sent with its fp32 scale (amax / 448).

Where afd's kernels are built, bf16 rows go through one native pass each way
(afd/kernels/fp8.c), bit for bit the torch code below: at decode sizes the torch code is ~7 ops
whose dispatch outweighs their arithmetic, and at `afd bench wire`'s size (T=128, H=7168) one
pass over each row still beats them. The torch code is the definition and the fallback:
PyTorch's own float8 -> bf16/fp32 casts run element by element, so `_dequantize_torch` rebuilds
the bits with three vectorised integer ops instead; on the way in the cast from fp32 is the
fastest of PyTorch's, so `_quantize_torch` works in fp32. The figures are in
docs/benchmarks.md.
"""

from __future__ import annotations

import math
import warnings

import torch

from afd.kernels import fp8

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows whose amax is below this are quantized against it instead, which keeps 0/0 out of
# all-zero rows without a branch (their values round to 0 either way).
_MIN_SCALE = 2.0**-126
# e4m3 bits SEEEEMMM placed at bf16/fp32 bit 15/31 and 10..4/26..20 read as 2^-120 times the
# fp8 value (normals and subnormals alike); the scale multiply undoes the 2^-120.
_REBIAS = 2.0**120
_BF16_MASK = -0x7810  # int16 0x87F0: sign + the 7 exponent/mantissa bits after << 4
_FP32_MASK = -0x78100000  # int32 0x87F00000: the same after << 20

# Received buffers are often read-only (bytes from gRPC); the tensors built on them are only
# read, so PyTorch's warning about it is noise. PyTorch gives it once per process: spend that
# once here, silenced, rather than filtering warnings globally.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8: x [T, H] (bf16/fp16/fp32) -> (q [T, H] float8_e4m3fn, scales [T] fp32).

    scales = amax(|x|, per row) / 448, so x ~= q * scales[:, None]; all-zero rows give q = 0.
    Non-finite inputs are not representable: a row holding inf or nan comes out as garbage.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 expects [T, H], got shape {tuple(x.shape)}")
    if x.numel() == 0:
        dev = x.device
        scales = torch.full((x.shape[0],), _MIN_SCALE, device=dev)
        return torch.empty(x.shape, dtype=FP8, device=dev), scales
    if x.dtype == torch.bfloat16 and fp8.usable(x):
        return fp8.quantize(x)  # one native pass, the same bits
    return _quantize_torch(x)


def _quantize_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float() if x.dtype != torch.float32 else x.clone()  # [T, H] fp32, ours to scale
    # amax without materialising |x|: max(max, -min) over two cheap reductions.
    amax = torch.maximum(xf.amax(dim=1), xf.amin(dim=1).neg_())  # [T]
    scales = amax.div_(FP8_MAX).clamp_min_(_MIN_SCALE)  # [T]
    q = xf.div_(scales[:, None]).to(FP8)  # |x / scale| <= 448 (+1 ulp, which rounds to 448)
    return q, scales


def dequantize_fp8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """q [T, H] float8_e4m3fn, scales [T] fp32 -> q * scales[:, None] as `dtype` [T, H].

    The product is computed in fp32 and rounded once to `dtype`.
    """
    if q.dim() != 2 or scales.shape != (q.shape[0],):
        raise ValueError(f"dequantize_fp8: q {tuple(q.shape)} and scales {tuple(scales.shape)}")
    scales = scales.to(torch.float32)
    if dtype == torch.bfloat16 and q.numel() and fp8.usable(q) and scales.is_contiguous():
        return fp8.dequantize(q, scales)  # one native pass, the same bits
    return _dequantize_torch(q, scales, dtype)


def _dequantize_torch(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Sign-extend the byte so one shift and one mask put sign, exponent and mantissa in place.
    bits = q.view(torch.int8).to(torch.int32).bitwise_left_shift_(20).bitwise_and_(_FP32_MASK)
    out = bits.view(torch.float32)  # [T, H] = fp8 value * 2^-120
    # (the check reads a value: on another device, where that is a sync, take the safe form)
    if q.device.type == "cpu" and scales.numel() and float(scales.max()) < 2.0**7:
        out.mul_((scales * _REBIAS)[:, None])  # finite: 2^7 * 2^120 < fp32 max
    else:  # huge scales (amax > 57344): undo the 2^-120 separately to stay finite
        out.mul_(_REBIAS).mul_(scales[:, None])
    return out if dtype == torch.float32 else out.to(dtype)


def tensor_to_buffer(t: torch.Tensor) -> memoryview:
    """A 1-D byte view of `t`'s memory (zero-copy when `t` is a contiguous CPU tensor).

    The view keeps the tensor alive; the bytes must not change until they have been sent.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # uint8 view first: numpy has no bf16/fp8, but any dtype reinterprets as bytes.
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def buffer_to_tensor(buf, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `dtype` and `shape` over the bytes of `buf` (any buffer; zero-copy).

    The caller checks that the sizes agree. The tensor shares memory with `buf` (and keeps it
    alive); treat it as read-only, since `buf` may be immutable.
    """
    nbytes = memoryview(buf).nbytes
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected:
        raise ValueError(f"buffer of {nbytes} bytes for {shape} {dtype} ({expected} bytes)")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # torch.frombuffer refuses empty buffers
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
