"""The sparse-attention indexer in native calls (indexer.c): its scores (the bf16 key pool read
in place, where the torch path gathers a row's blocks and widens them to fp32 before its
matmul), the top-k rule both DSA decode paths select by, and the weights the fused MLA layer
takes to select a decode batch's rows itself."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from afd.blockfp8 import BlockFP8
from afd.kernels import gemm, paths
from afd.kernels.fp8_gemm import FP8Ref, fp8_block


def usable(pool: torch.Tensor, q: torch.Tensor) -> bool:
    """A bf16 pool and queries on the CPU, D a multiple of 8 up to 256, afd's kernels on this
    path."""
    D = pool.shape[-1]
    return (
        pool.dtype == torch.bfloat16
        and q.dtype == torch.bfloat16  # the kernels read the queries as bf16
        and pool.device.type == "cpu"
        and pool.is_contiguous()
        and D % 8 == 0
        and D <= 256
        and q.shape[-1] == D
        and paths.active().native
    )


def index_scores(
    q: torch.Tensor,  # [n, hI, Di] bf16 (usable)
    weights: torch.Tensor,  # [n, hI] float32
    pool: torch.Tensor,  # [NB, bs, Di] bf16
    blocks: torch.Tensor,  # [1 or n, nb] long
    scale: float,
) -> torch.Tensor:  # [n, nb * bs] float32
    n, H, D = q.shape
    NB, bs, _ = pool.shape
    nb = blocks.shape[1]
    q = q.contiguous()
    wf = weights.float().contiguous()
    blocks = blocks.contiguous()
    out = torch.empty(n, nb * bs, dtype=torch.float32)
    rc = gemm._lib().afd_bf16_index_scores(
        q.data_ptr(), wf.data_ptr(), pool.data_ptr(), blocks.data_ptr(),
        int(blocks.shape[0] == 1), out.data_ptr(), n, H, D, NB, nb, bs, scale,
        torch.get_num_threads(), paths.isa(),
    )  # fmt: skip
    if rc:
        raise RuntimeError("afd_bf16_index_scores: a block id outside the pool")
    return out


def topk_positions(
    scores: torch.Tensor | None,  # [n, L] float32; None where no row sees more than k
    k: int,
    lens: torch.Tensor,  # [n] long: row i sees its first lens[i] positions
    L: int | None = None,  # the positions a row has (scores' width, where scores is None)
) -> tuple[torch.Tensor, torch.Tensor]:  # pos [n, k] long, count [n] long
    """Each row's selection among the positions it sees: all of them where they are at most k
    (their scores unread), else the k highest scores (NaN below every number; among equal
    scores at the cut the lower positions), ascending in its first count[i] entries (the rest
    0). torch's topk breaks such ties its own way, so the fused layer's selection and the
    per-op path's agree only if both take this one."""
    n = lens.shape[0]
    if scores is not None:
        L = scores.shape[1]
        scores = scores.float().contiguous()
    elif L is None:
        raise ValueError("topk_positions: without scores, L says how many positions a row has")
    lens = lens.to(torch.long).contiguous()
    pos = torch.empty(n, k, dtype=torch.long)
    count = torch.empty(n, dtype=torch.long)
    rc = gemm._lib().afd_topk_positions(
        scores.data_ptr() if scores is not None else None, n, L, k, lens.data_ptr(),
        pos.data_ptr(), count.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(
            f"topk_positions: k {k} below 1, a length outside [0, {L}] (above k without "
            "scores), or no memory"
        )
    return pos, count


@dataclass(frozen=True)
class IndexerWeights:
    """What DSA adds to the fused MLA layer (dsa.py: decode_weights): the indexer's matmul
    weights laid out for the layer's path, its key's LayerNorm and sizes."""

    w_q: torch.Tensor | BlockFP8  # [heads * dim, qr]; block-FP8 (w_k too): converted as it goes
    w_k: torch.Tensor | BlockFP8  # [dim + heads, H]: the key, then the heads' weights
    k_norm: torch.Tensor  # [dim] bf16
    k_bias: torch.Tensor  # [dim] bf16
    heads: int
    dim: int
    topk: int
    norm_eps: float


class Indexer(ctypes.Structure):
    """indexer.h's afd_indexer: the same fields in the same order."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("w_q", "w_k", "k_norm", "k_bias")] + [
        ("heads", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("topk", ctypes.c_int64),
        ("weight_scale", ctypes.c_double),
        ("score_scale", ctypes.c_double),
        ("norm_eps", ctypes.c_double),
        ("f8_q", FP8Ref),
        ("f8_k", FP8Ref),
        ("bk", ctypes.c_int64),
    ]

    @classmethod
    def of(cls, iw: IndexerWeights) -> Indexer:
        """The struct for iw (whose tensors the caller keeps referenced); the scales as
        dsa.py computes them, in double, cast to float by the call."""
        ptr = lambda w: w.data_ptr() if isinstance(w, torch.Tensor) else None  # noqa: E731
        return cls(
            ptr(iw.w_q), ptr(iw.w_k), iw.k_norm.data_ptr(), iw.k_bias.data_ptr(),
            iw.heads, iw.dim, iw.topk, iw.heads**-0.5, iw.dim**-0.5, iw.norm_eps,
            FP8Ref.of(iw.w_q), FP8Ref.of(iw.w_k), fp8_block(iw.w_q, iw.w_k) or 0,
        )  # fmt: skip
