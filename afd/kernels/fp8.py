"""The per-token FP8 codec in one native call each way (fp8.c), bit for bit the torch path of
afd/quant.py: a decode micro-batch's quantize or dequantize is ~7 torch ops there (mostly
dispatch at that size, on every layer of both sides), one pass over the row here."""

from __future__ import annotations

import torch

from afd.kernels import gemm, paths


def usable(x: torch.Tensor) -> bool:
    """x [T, H] contiguous on the CPU, H % 8 == 0, the library loaded."""
    return (
        x.dim() == 2
        and x.device.type == "cpu"
        and x.is_contiguous()
        and x.shape[1] % 8 == 0
        and gemm.available()
    )


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] bf16 -> (q [T, H] float8_e4m3fn, scales [T] fp32)."""
    T, H = x.shape
    q = torch.empty((T, H), dtype=torch.float8_e4m3fn)
    scales = torch.empty(T, dtype=torch.float32)
    if gemm._lib().afd_fp8_quantize(
        x.data_ptr(), q.data_ptr(), scales.data_ptr(), T, H, torch.get_num_threads(), paths.isa()
    ):
        raise RuntimeError(f"afd_fp8_quantize failed for {tuple(x.shape)}")
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [T, H] float8_e4m3fn, scales [T] fp32 (contiguous) -> [T, H] bf16."""
    T, H = q.shape
    y = torch.empty((T, H), dtype=torch.bfloat16)
    if gemm._lib().afd_fp8_dequantize(
        q.data_ptr(), scales.data_ptr(), y.data_ptr(), T, H, torch.get_num_threads(), paths.isa()
    ):
        raise RuntimeError(f"afd_fp8_dequantize failed for {tuple(q.shape)}")
    return y
