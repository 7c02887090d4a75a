"""MXFP4 weights, as gpt-oss ships its experts, kept in 4 bits in memory.

A weight W [N, K] is stored as `blocks` [N, K/32, 16] uint8 (two e2m1 values a byte, the
element at the even index in the low nibble) and `scales` [N, K/32] uint8 (an e8m0 exponent,
2^(s - 127), per 32 consecutive values of a row): 4.25 bits a weight. Rows are independent, so
the row operations loading does (splitting gpt-oss's interleaved gate/up rows, concatenating
gate and up) work on it as on dense tensors. Two ways to multiply (services/ffn chooses):
`linear` reads the 4-bit values directly (afd's native kernel, mxfp4.c), `dequantize` expands
rows into a compute dtype (the online conversion the expert workspace keeps).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

BLOCK = 32  # values per scale
# e2m1 code -> value: sign bit 3, exponent bits 2..1, mantissa bit 0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
SCALE_BIAS = 127
# Scale bytes for which every e2m1 value times the scale is a normal bf16 number (0.5 and 6 have
# exponents -1 and 2), so a kernel may fold the scale into the values exactly (mxfp4_amx.c)
FOLDABLE_SCALES = (2, 252)


@dataclass(frozen=True)
class MXFP4:
    """W [N, K] = e2m1 values times a power of two per 32-value block of a row."""

    blocks: torch.Tensor  # [N, K/32, 16] uint8
    scales: torch.Tensor  # [N, K/32] uint8, biased exponents

    @staticmethod
    def from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor) -> MXFP4:
        """`*_blocks` [N, G, 16] and `*_scales` [N, G] uint8, as gpt-oss stores one expert's."""
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}")
        if blocks.dim() != 3 or blocks.shape[2] != BLOCK // 2:
            raise ValueError(f"MXFP4 blocks of shape {tuple(blocks.shape)}, expected [N, G, 16]")
        if tuple(scales.shape) != tuple(blocks.shape[:2]):
            raise ValueError(
                f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}"
            )
        return MXFP4(blocks.contiguous(), scales.contiguous())

    @property
    def shape(self) -> torch.Size:
        n, g, _ = self.blocks.shape
        return torch.Size((n, g * BLOCK))

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def to(self, device: torch.device) -> MXFP4:
        return MXFP4(self.blocks.to(device), self.scales.to(device))

    def rows(self, index: torch.Tensor | slice) -> MXFP4:
        return MXFP4(self.blocks[index].contiguous(), self.scales[index].contiguous())

    @staticmethod
    def cat(parts: list[MXFP4]) -> MXFP4:
        return MXFP4(torch.cat([p.blocks for p in parts]), torch.cat([p.scales for p in parts]))

    def dequantize(self, dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
        """Rows of W as `dtype` (exact: every MXFP4 value is a bf16 value)."""
        from afd.kernels import mxfp4 as native

        b, s = self.blocks[rows], self.scales[rows]
        if dtype == torch.bfloat16 and native.usable():
            return native.to_bf16(b, s)
        lut = torch.tensor(E2M1, dtype=torch.float32, device=b.device)
        n, g, _ = b.shape
        vals = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)  # [n,g,16,2]
        exp = s.to(torch.int32) - SCALE_BIAS
        w = torch.ldexp(vals.view(n, g, BLOCK), exp.unsqueeze(-1)).view(n, g * BLOCK)
        return w.to(dtype)

    @cached_property
    def foldable(self) -> bool:
        """Every block holding a nonzero value has its scale within FOLDABLE_SCALES (checked once
        per weight). A block of zeros may have any scale (quantize gives it the smallest): the
        fold leaves +-0 alone."""
        lo, hi = FOLDABLE_SCALES
        outside = (self.scales < lo) | (self.scales > hi)  # [N, G]
        if not bool(outside.any()):
            return True
        nonzero = (self.blocks & 0x77).ne(0).any(-1)  # a code other than +-0 (0 and 8) in a block
        return not bool((outside & nonzero).any())

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W.T -> [..., N], reading the 4-bit values directly where afd's kernel
        runs (bf16 or float32 on an AVX2 CPU), else through a dequantized copy."""
        from afd.kernels import mxfp4 as native

        kernel_dtype = x.dtype in (torch.bfloat16, torch.float32)
        if kernel_dtype and x.device.type == "cpu" and native.usable():
            return native.linear(x, self.blocks, self.scales, self.foldable)
        return F.linear(x, self.dequantize(x.dtype))


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (K % 32 == 0) -> (blocks [N, K/32, 16], scales [N, K/32]) uint8: each block's
    scale the smallest power of two that fits its largest magnitude in e2m1's 6, each value
    rounded to the nearest e2m1 value (ties to the even code)."""
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"MXFP4 needs K % {BLOCK} == 0, got {K}")
    x = w.float().reshape(N, K // BLOCK, BLOCK)
    amax = x.abs().amax(dim=-1)  # [N, G]
    # 2^e with amax / 2^e <= 6: e = ceil(log2(amax / 6)), computed exactly with frexp
    mant, e = torch.frexp(amax / E2M1_MAX)  # amax/6 = mant * 2^e, mant in [0.5, 1)
    e = torch.where(mant == 0.5, e - 1, e)  # an exact power of two needs no rounding up
    e = torch.where(amax > 0, e, torch.full_like(e, -SCALE_BIAS))
    e = e.clamp(-SCALE_BIAS, 255 - SCALE_BIAS)
    y = torch.ldexp(x, -e.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)  # in [-6, 6]
    codes = _e2m1_codes(y)  # [N, G, 32] uint8
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (e + SCALE_BIAS).to(torch.uint8)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Values in [-6, 6] -> the nearest e2m1 code, a tie going to the even code."""
    mags = torch.tensor(E2M1[:8])  # 0, .5, 1, 1.5, 2, 3, 4, 6: codes 0..7
    a = y.abs().unsqueeze(-1)
    dist = (a - mags).abs()  # [..., 8]
    best = dist.min(dim=-1, keepdim=True).values
    # among the nearest (one, or two at a tie), the even code: codes 0..7, an even one first
    tie_break = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]) * 0.5 + torch.arange(8) * 1e-3
    code = torch.where(dist == best, tie_break, torch.full_like(dist, 9.0)).argmin(dim=-1)
    sign = (y < 0) & (code > 0)
    return (code + sign.to(code.dtype) * 8).to(torch.uint8)
