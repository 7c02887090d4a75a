"""The sparse-attention indexer's scores in one native call (afd_bf16_index_scores in
indexer.c): the bf16 key pool read in place, where the torch path gathers a row's blocks and
widens them to fp32 before its matmul."""

from __future__ import annotations

import torch

from afd.kernels import gemm, paths


def usable(pool: torch.Tensor, q: torch.Tensor) -> bool:
    """A bf16 pool on the CPU, D a multiple of 8 up to 256, afd's kernels on this path."""
    D = pool.shape[-1]
    return (
        pool.dtype == torch.bfloat16
        and pool.device.type == "cpu"
        and pool.is_contiguous()
        and D % 8 == 0
        and D <= 256
        and q.shape[-1] == D
        and paths.active().native
    )


def index_scores(
    q: torch.Tensor,  # [n, hI, Di] (any float dtype; widened to fp32)
    weights: torch.Tensor,  # [n, hI] float32
    pool: torch.Tensor,  # [NB, bs, Di] bf16
    blocks: torch.Tensor,  # [1 or n, nb] long
    scale: float,
) -> torch.Tensor:  # [n, nb * bs] float32
    n, H, D = q.shape
    NB, bs, _ = pool.shape
    nb = blocks.shape[1]
    qf = q.float().contiguous()
    wf = weights.float().contiguous()
    blocks = blocks.contiguous()
    out = torch.empty(n, nb * bs, dtype=torch.float32)
    rc = gemm._lib().afd_bf16_index_scores(
        qf.data_ptr(), wf.data_ptr(), pool.data_ptr(), blocks.data_ptr(),
        int(blocks.shape[0] == 1), out.data_ptr(), n, H, D, NB, nb, bs, scale,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise RuntimeError("afd_bf16_index_scores: a block id outside the pool")
    return out
