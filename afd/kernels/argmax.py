"""Greedy decoding's argmax over the logits in one native call (argmax.c): torch's reduction
over the last dimension walks each row an element at a time, a visible part of a batch-32
decode step on a 32k vocabulary (docs/benchmarks.md)."""

from __future__ import annotations

import torch

from afd.kernels import gemm


def usable(logits: torch.Tensor) -> bool:
    """logits [B, V] float32, contiguous, on the CPU, with the native library loaded."""
    return (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.device.type == "cpu"
        and logits.is_contiguous()
        and logits.shape[1] > 0
        and gemm.available()
    )


def rows(logits: torch.Tensor) -> torch.Tensor:  # [B] int64
    """torch.argmax(logits, dim=-1) (the first of equal maxima, a NaN the largest; see usable)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64)
    threads = torch.get_num_threads()
    if gemm._lib().afd_argmax_rows(logits.data_ptr(), B, V, out.data_ptr(), threads):
        raise RuntimeError(f"afd_argmax_rows failed for {tuple(logits.shape)}")
    return out
