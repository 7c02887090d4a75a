"""A dense MLP added into a result in one native call (mlp.c): DeepSeek's shared expert and a
dense layer's MLP, on the FFN side and in the decode stack alike, so both give the same bits."""

from __future__ import annotations

import torch

from afd.kernels import gemm
from afd.kernels.moe import ACTS, ActSpec


class NativeMLP:
    """w13 [2I, H] (gate rows, then up rows) and w2 [H, I], bf16, laid out for path `isa`'s
    matmul (ops.Linear's weights; kept referenced here)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, isa: str, act: ActSpec):
        if not self.usable(w13, w2) or isa not in gemm.ISAS or act[0] not in ACTS:
            raise ValueError(f"NativeMLP: {tuple(w13.shape)}, {tuple(w2.shape)} on {isa}")
        self.w13, self.w2, self.isa = w13, w2, gemm.ISAS[isa]
        self.hidden, self.inter = w2.shape
        self.act, self.limit, self.alpha = ACTS[act[0]], act[1], act[2]

    @staticmethod
    def usable(w13: torch.Tensor, w2: torch.Tensor) -> bool:
        hidden, inter = w2.shape
        return (
            gemm.available()
            and hidden % 8 == 0
            and inter % 8 == 0
            and w13.shape == (2 * inter, hidden)
            and all(
                w.dtype == torch.bfloat16 and w.is_contiguous() and w.device.type == "cpu"
                for w in (w13, w2)
            )
        )

    def add_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, H] += the MLP of x [T, H] (both bf16, contiguous), rounded once; returns out."""
        T = x.shape[0]
        if T == 0:
            return out
        if not (x.is_contiguous() and out.is_contiguous()) or out.shape != x.shape:
            raise ValueError(f"NativeMLP: x {tuple(x.shape)} and out {tuple(out.shape)}")
        rc = gemm._lib().afd_bf16_mlp_add(
            x.data_ptr(), self.w13.data_ptr(), self.w2.data_ptr(), out.data_ptr(), T,
            self.hidden, self.inter, self.act, self.limit, self.alpha, torch.get_num_threads(),
            self.isa,
        )  # fmt: skip
        if rc:
            raise RuntimeError("afd_bf16_mlp_add failed (out of memory?)")
        return out
