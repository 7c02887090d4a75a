"""Block-FP8 weights, as DeepSeek ships them, kept in FP8 in memory.

A checkpoint quantized this way (`quantization_config.quant_method: "fp8"`,
`weight_block_size: [bn, bk]`) stores a weight W [N, K] as e4m3 values plus one float32
`weight_scale_inv` per bn x bk block, W ~= w8 * scale_inv. afd keeps w8 (one byte a weight) and
the scales repeated per row ([N, ceil(K / bk)]: a few percent of w8's bytes), so that the row
operations the services do while loading (concatenating q/k/v or gate/up, permuting rows) work
on FP8 as they do on dense tensors. A matmul dequantizes a run of rows at a time into a small
scratch buffer and multiplies that (`BlockFP8.linear`); the whole weight is never expanded.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from afd.mxfp4 import MXFP4

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# e4m3 bits placed at fp32 bits 26..20 (and the sign at 31) read as 2^-120 times the fp8 value
_FP32_MASK = -0x78100000
_REBIAS = 2.0**120
# rows dequantized per matmul call: a scratch of about this many weights
_SCRATCH_WEIGHTS = 1 << 19

_scratch = threading.local()


@dataclass(frozen=True)
class BlockFP8:
    """W [N, K] ~= q * scale (per row, per K-block of `block_k` columns)."""

    q: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N, ceil(K / block_k)] float32
    block_k: int

    @staticmethod
    def from_checkpoint(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
        """q [N, K] e4m3 and its scale_inv [ceil(N/bn), ceil(K/bk)] as stored (float32, or
        e8m0 powers of two) -> per-row scales."""
        bn, bk = block
        N, K = q.shape
        nN, nK = -(-N // bn), -(-K // bk)
        if tuple(scale_inv.shape) != (nN, nK):
            raise ValueError(
                f"scale_inv {tuple(scale_inv.shape)} does not tile {N}x{K} in {bn}x{bk} blocks"
            )
        scale = scale_inv.float() if scale_inv.dtype != torch.uint8 else _e8m0(scale_inv)
        if q.dtype != FP8:
            raise ValueError(f"block-FP8 weight of dtype {q.dtype}, expected {FP8}")
        return BlockFP8(q.contiguous(), scale.repeat_interleave(bn, dim=0)[:N].contiguous(), bk)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.q.device

    def to(self, device: torch.device) -> BlockFP8:
        return BlockFP8(self.q.to(device), self.scale.to(device), self.block_k)

    def rows(self, index: torch.Tensor | slice) -> BlockFP8:
        return BlockFP8(self.q[index].contiguous(), self.scale[index].contiguous(), self.block_k)

    def dequantize(self, dtype: torch.dtype, rows: slice = slice(None), out=None) -> torch.Tensor:
        """Rows of W as `dtype`: each value times its block's scale in float32, rounded once."""
        q, s = self.q[rows], self.scale[rows]
        n, K = q.shape
        bits = q.view(torch.int8).to(torch.int32).bitwise_left_shift_(20).bitwise_and_(_FP32_MASK)
        w = bits.view(torch.float32)  # [n, K] = fp8 value * 2^-120
        full, tail = divmod(K, self.block_k)
        bk = self.block_k
        if full:
            w[:, : full * bk].view(n, full, bk).mul_(s[:, :full, None] * _REBIAS)
        if tail:
            w[:, full * bk :].mul_(s[:, full:] * _REBIAS)
        if out is None:
            return w if dtype == torch.float32 else w.to(dtype)
        return out.copy_(w)

    def linear(self, x: torch.Tensor, kernel=None) -> torch.Tensor:
        """x [..., K] @ W.T -> [..., N], W dequantized a run of rows at a time into a scratch
        buffer; `kernel(x, w_rows)` multiplies (F.linear unless given)."""
        kernel = kernel or F.linear
        N, K = self.q.shape
        out = x.new_empty(*x.shape[:-1], N)
        # whole groups of 4 rows (gemm.pack) and of 16 (pack_tiles): each run's rows sum as
        # the dense weight's do
        step = max(16, _SCRATCH_WEIGHTS // K // 16 * 16)
        buf = _scratch_buffer(step * K, x.dtype, x.device)
        for a in range(0, N, step):
            b = min(N, a + step)
            w = self.dequantize(x.dtype, slice(a, b), out=buf[: (b - a) * K].view(b - a, K))
            out[..., a:b] = kernel(x, w)
        return out


def cat_rows(parts: list) -> torch.Tensor | BlockFP8 | MXFP4:
    """Row-wise concatenation of dense tensors, of MXFP4 weights, or of BlockFP8 weights with
    one block width (a mix is dequantized: the dense part cannot be FP8 without a rounding it
    never had)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, MXFP4) for p in parts):
        return MXFP4.cat(parts)
    fp8 = [p for p in parts if isinstance(p, BlockFP8)]
    if len(fp8) == len(parts) and len({p.block_k for p in fp8}) == 1:
        return BlockFP8(
            torch.cat([p.q for p in fp8]), torch.cat([p.scale for p in fp8]), fp8[0].block_k
        )
    dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
    return torch.cat([dense(p, dtype) for p in parts])


def take_rows(w, index: torch.Tensor | slice):
    """Rows of a dense, BlockFP8 or MXFP4 weight (or of a bias), contiguous."""
    if isinstance(index, torch.Tensor):  # built on the host; the weight may be elsewhere
        index = index.to(w.device)
    return w[index].contiguous() if isinstance(w, torch.Tensor) else w.rows(index)


def dense(w: torch.Tensor | BlockFP8 | MXFP4, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a dense tensor of `dtype` (where a consumer needs one: embeddings, MLA's
    absorbed per-head matrices)."""
    return w.to(dtype) if isinstance(w, torch.Tensor) else w.dequantize(dtype)


# canonical names that stay in high precision: read whole, or where 8 bits cost too much
_KEEP = ("embed", "lm_head", "final_norm")


def covers(name: str, t: torch.Tensor) -> bool:
    """Whether a tensor (by its canonical name) is a matmul weight that block-FP8 quantizes:
    attention projections, experts, shared experts and dense MLPs; not embeddings, the LM head,
    norms, routers or DSA's indexer head weights (as DeepSeek's checkpoints keep them)."""
    if t.dim() not in (2, 3) or name in _KEEP:
        return False
    # DSA's indexer head weights too: a bf16 Linear beside its FP8 wq_b and wk in V3.2
    return not name.endswith((".router", ".router_bias", "norm", ".index_weights"))


def quantize_blocks(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (w8 [N, K] e4m3, scale_inv [ceil(N/bn), ceil(K/bk)] float32), as DeepSeek's
    checkpoints hold it: each block scaled so its largest magnitude maps to 448."""
    bn, bk = block
    N, K = w.shape
    nN, nK = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nN * bn, nK * bk, dtype=torch.float32)
    padded[:N, :K] = w.float()
    blocks = padded.view(nN, bn, nK, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [nN, nK]
    scale = (amax / FP8_MAX).clamp_min(2.0**-126)
    q = (blocks / scale[:, None, :, None]).to(FP8).view(nN * bn, nK * bk)[:N, :K]
    return q.contiguous(), scale


def _e8m0(x: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (a biased power-of-two exponent per byte) -> float32."""
    return torch.pow(2.0, x.to(torch.float32) - 127.0)


def _scratch_buffer(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = f"buf_{dtype}_{device}"
    buf = getattr(_scratch, key, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype, device=device)
        setattr(_scratch, key, buf)
    return buf
