"""A block-FP8 weight (afd/blockfp8.py) multiplied in one native call on a bf16 path's own
matmul (fp8_gemm.c): each thread converts a chunk of rows into the layout that path reads a
dense weight in and multiplies it while it is in cache. The weights are BlockFP8.dequantize's
bf16 numbers, so the result is the dense weight's on the same path, bit for bit."""

from __future__ import annotations

import ctypes

import torch

from afd.blockfp8 import BlockFP8
from afd.kernels import gemm


class FP8Ref(ctypes.Structure):
    """fp8_gemm.h's afd_fp8_ref: a block-FP8 weight's codes and scales in a fused call's struct
    (q None: the weight is bf16)."""

    _fields_ = [("q", ctypes.c_void_p), ("s", ctypes.c_void_p)]

    @staticmethod
    def of(w) -> FP8Ref:
        """w's codes and scales where it is block-FP8, else NULLs."""
        if isinstance(w, BlockFP8):
            return FP8Ref(w.q.data_ptr(), w.scale.data_ptr())
        return FP8Ref(None, None)


def fp8_block(*ws) -> int | None:
    """The K-block width of the block-FP8 weights among ws (0: none; None: two widths, or
    codes off the CPU)."""
    fp8 = [w for w in ws if isinstance(w, BlockFP8)]
    if any(w.q.device.type != "cpu" for w in fp8) or len({w.block_k for w in fp8}) > 1:
        return None
    return fp8[0].block_k if fp8 else 0


def usable(x: torch.Tensor, w: BlockFP8, isa: str) -> bool:
    """x bf16 on the CPU, w's codes there too, `isa` one of afd's matmul paths with its K."""
    return (
        isa in gemm.K_MULTIPLE
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and w.q.device.type == "cpu"
        and w.shape[1] % gemm.K_MULTIPLE[isa] == 0
        and gemm.available()
    )


def linear(x: torch.Tensor, w: BlockFP8, isa: str) -> torch.Tensor:
    """x [..., K] bf16 @ W.T -> [..., N] bf16 for a block-FP8 W [N, K] (where usable)."""
    n, k = w.shape
    x2, m, y = gemm.matmul_io(x, n, k)
    if m and gemm._lib().afd_fp8_gemm(
        x2.data_ptr(), w.q.data_ptr(), w.scale.data_ptr(), y.data_ptr(), m, n, k, w.block_k,
        gemm.ISAS[isa], torch.get_num_threads(),
    ):  # fmt: skip
        raise RuntimeError(f"afd_fp8_gemm failed for x {tuple(x.shape)} @ w {tuple(w.shape)}")
    return y
