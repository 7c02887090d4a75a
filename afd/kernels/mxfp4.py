"""MXFP4 weights through afd's native kernels (mxfp4.c): a bf16 matmul that reads the 4-bit
codes directly, and the expansion of rows into bf16."""

from __future__ import annotations

import ctypes

import torch

from afd.kernels import gemm, paths
from afd.kernels.moe import ACTS, ActSpec


def usable() -> bool:
    """afd's kernels run on the active path (AFD_KERNELS: amx, avx512bf16 or avx2; an AVX2 CPU
    is all these need); elsewhere MXFP4 goes through torch."""
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


def isa(foldable: bool) -> int:
    """The kernels' isa argument on the active path for MXFP4 weights: AMX tiles only where
    every scale can be folded into the bf16 values exactly (MXFP4.foldable), else AVX-512 BF16
    (or AVX2)."""
    code = gemm.ISAS.get(paths.active().matmul, 0)
    return gemm.ISAS["avx512bf16"] if code == gemm.ISAS["amx"] and not foldable else code


def linear(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, foldable: bool = False
) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype (bf16 or float32), W [N, K] as MXFP4 blocks
    and scales (foldable: MXFP4.foldable, which lets the AMX route take it)."""
    N, G, _ = blocks.shape
    K = G * 32
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    f32 = x.dtype == torch.float32
    y = torch.empty(x.shape[:-1] + (N,), dtype=x.dtype)
    if M and gemm._lib().afd_mxfp4_linear(
        x2.data_ptr(), blocks.data_ptr(), scales.data_ptr(), y.data_ptr(), M, N, K, int(f32),
        isa(foldable), torch.get_num_threads(),
    ):  # fmt: skip
        raise RuntimeError(f"afd_mxfp4_linear failed for x {tuple(x.shape)} @ w [{N}, {K}]")
    return y


class FusedExperts:
    """A layer's MXFP4 experts in one native call (afd_mxfp4_moe in mxfp4_moe.c): the torch
    path's pair sorting, matmuls, biases, activation and weighted sum, with its roundings."""

    def __init__(
        self,
        w13: list,  # E x MXFP4 [2I, H] (gate rows, then up rows)
        w2: list,  # E x MXFP4 [H, I]
        b13: list[torch.Tensor] | None,  # E x [2I], or None
        b2: list[torch.Tensor] | None,  # E x [H], or None
        act: ActSpec,
    ):
        self.count = len(w13)
        self.hidden, self.inter = w2[0].shape
        self.act, self.limit, self.alpha = ACTS[act[0]], act[1], act[2]
        # the tensors stay referenced: the pointer arrays point into them
        self._keep = [m.blocks for m in (*w13, *w2)] + [m.scales for m in (*w13, *w2)]
        self.foldable = all(m.foldable for m in (*w13, *w2))
        self._b13 = [b.to(torch.bfloat16).contiguous() for b in b13] if b13 else None
        self._b2 = [b.to(torch.bfloat16).contiguous() for b in b2] if b2 else None

        def ptrs(ts):
            return (ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts)) if ts else None

        self._p = [
            *(ptrs([m.blocks for m in w13]), ptrs([m.scales for m in w13]), ptrs(self._b13)),
            *(ptrs([m.blocks for m in w2]), ptrs([m.scales for m in w2]), ptrs(self._b2)),
        ]

    @staticmethod
    def usable(w13: list, w2: list) -> bool:
        if not (w13 and usable()):
            return False
        hidden, inter = w2[0].shape
        return (
            hidden % 32 == 0
            and inter % 32 == 0
            and all(m.shape == (2 * inter, hidden) for m in w13)
            and all(m.shape == (hidden, inter) for m in w2)
            and all(m.blocks.device.type == "cpu" for m in (*w13, *w2))
            and all(m.blocks.is_contiguous() and m.scales.is_contiguous() for m in (*w13, *w2))
        )

    def __call__(
        self,
        x: torch.Tensor,  # [T, H] bf16
        expert_ids: torch.Tensor,  # [T, k] int: global ids as routed (other shards' skipped)
        expert_weights: torch.Tensor,  # [T, k] float: routing weights
        first: int,  # global id of the first expert held
        out: torch.Tensor,  # [T, H] bf16, contiguous, accumulated into
    ) -> None:
        x = x if x.is_contiguous() else x.contiguous()
        ids = expert_ids.to(torch.int32).contiguous()
        w = expert_weights.float().contiguous()
        rc = gemm._lib().afd_mxfp4_moe(
            x.data_ptr(), ids.data_ptr(), w.data_ptr(), ids.shape[1], first, *self._p,
            out.data_ptr(), out.shape[0], self.count, self.hidden, self.inter, self.act,
            self.limit, self.alpha, torch.get_num_threads(), isa(self.foldable),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"afd_mxfp4_moe failed ({rc}: out of memory?)")
