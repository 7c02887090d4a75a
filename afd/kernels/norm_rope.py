"""RMSNorm and RoPE in one native call each (norm_rope.c), for the attention side's decode
path, where torch's ~6-12 tiny ops per call cost more than the arithmetic."""

from __future__ import annotations

import torch

from afd.kernels import gemm, paths


def usable(x: torch.Tensor, multiple: int) -> bool:
    """x [..., D] bf16 on the CPU, last dim contiguous and a multiple of `multiple` (8 for
    rms_norm, 16 for rope), and the kernel path one of afd's own (paths.py)."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and x.shape[-1] % multiple == 0
        and paths.active().native
    )


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x as [A, B, D] with strides (sa, sb, 1) without a copy: 2-d rows, or 3-d heads."""
    if x.dim() == 3:
        return x.shape[0], x.stride(0), x.shape[1], x.stride(1)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2.shape[0], x2.stride(0), 1, 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (last dim contiguous; 3-d views may be strided) -> contiguous [..., D]."""
    D = x.shape[-1]
    if x.dim() > 3 or (x.dim() == 2 and x.stride(0) < D):
        x = x.contiguous()
    A, sa, B, sb = _rows(x)
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    w = weight.contiguous()
    threads, isa = torch.get_num_threads(), paths.isa()
    rc = gemm._lib().afd_bf16_rms_norm(
        x.data_ptr(), sa, sb, w.data_ptr(), y.data_ptr(), A, B, D, eps, threads, isa
    )
    if rc:
        raise RuntimeError(f"afd_bf16_rms_norm failed for {tuple(x.shape)}")
    return y


def rope(
    x: torch.Tensor,  # [T, heads, D] bf16, heads contiguous within a token (stride(1) == D)
    cos: torch.Tensor,  # [P, D] bf16
    sin: torch.Tensor,  # [P, D] bf16
    positions: torch.Tensor,  # [T] long
) -> torch.Tensor:  # [T, heads, D] contiguous
    T, H, D = x.shape
    if x.stride(1) != D:
        x = x.contiguous()
    pos = positions.contiguous()
    y = torch.empty(T, H, D, dtype=torch.bfloat16)
    rc = gemm._lib().afd_bf16_rope(
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        T,
        H,
        D,
        cos.data_ptr(),
        sin.data_ptr(),
        pos.data_ptr(),
        torch.get_num_threads(),
        paths.isa(),
    )
    if rc:
        raise RuntimeError(f"afd_bf16_rope failed for {tuple(x.shape)}")
    return y


def layer_norm(
    x: torch.Tensor,  # [T, D] bf16, rows may be strided (a split of a fused projection)
    weight: torch.Tensor,  # [D]
    bias: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:  # [T, D] contiguous
    """F.layer_norm of bf16 rows, statistics in fp32 (norm_rope.c: afd_bf16_layer_norm): the
    call DSA's fused layer makes, so its per-op path makes it too."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, D = x.shape
    w, b = weight.to(torch.bfloat16).contiguous(), bias.to(torch.bfloat16).contiguous()
    y = torch.empty(T, D, dtype=torch.bfloat16)
    rc = gemm._lib().afd_bf16_layer_norm(
        x.data_ptr(), x.stride(0), w.data_ptr(), b.data_ptr(), y.data_ptr(), T, D, eps
    )
    if rc:
        raise RuntimeError(f"afd_bf16_layer_norm failed for {tuple(x.shape)}")
    return y
