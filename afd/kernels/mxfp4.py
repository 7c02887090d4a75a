"""MXFP4 weights through afd's native kernels (mxfp4.c): a bf16 matmul that reads the 4-bit
codes directly, and the expansion of rows into bf16."""

from __future__ import annotations

import torch

from afd.kernels import gemm, paths


def usable() -> bool:
    """afd's kernels run on the active path (AFD_KERNELS: avx2 or avx512bf16; an AVX2 CPU is
    all these need); elsewhere MXFP4 goes through torch."""
    return paths.active().native


def to_bf16(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [N, G, 16], scales [N, G] uint8 (contiguous) -> W [N, 32 G] bf16."""
    N, G, _ = blocks.shape
    out = torch.empty(N, G * 32, dtype=torch.bfloat16)
    b, s = blocks.contiguous(), scales.contiguous()
    lib = gemm._lib()
    if lib.afd_mxfp4_to_bf16(b.data_ptr(), s.data_ptr(), out.data_ptr(), N, G * 32,
                             torch.get_num_threads()):  # fmt: skip
        raise RuntimeError(f"afd_mxfp4_to_bf16 failed for {tuple(blocks.shape)}")
    return out


def linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype (bf16 or float32), W [N, K] as MXFP4 blocks
    and scales."""
    N, G, _ = blocks.shape
    K = G * 32
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    f32 = x.dtype == torch.float32
    isa = gemm.ISAS.get(paths.active().matmul, 0)  # AVX-512 BF16 where the path runs it
    y = torch.empty(x.shape[:-1] + (N,), dtype=x.dtype)
    if M and gemm._lib().afd_mxfp4_linear(
        x2.data_ptr(), blocks.data_ptr(), scales.data_ptr(), y.data_ptr(), M, N, K, int(f32),
        isa, torch.get_num_threads(),
    ):  # fmt: skip
        raise RuntimeError(f"afd_mxfp4_linear failed for x {tuple(x.shape)} @ w [{N}, {K}]")
    return y
