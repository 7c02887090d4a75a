"""A dense MLP added into a result in one native call (mlp.c): DeepSeek's shared expert and a
dense layer's MLP, on the FFN side and in the decode stack alike, so both give the same bits."""

from __future__ import annotations

import torch

from afd.blockfp8 import BlockFP8
from afd.kernels import gemm
from afd.kernels.fp8_gemm import FP8Ref
from afd.kernels.moe import ACTS, ActSpec

Weight = torch.Tensor | BlockFP8


class NativeMLP:
    """w13 [2I, H] (gate rows, then up rows) and w2 [H, I], bf16, laid out for path `isa`'s
    matmul (ops.Linear's weights; kept referenced here), or both block-FP8 with one K-block,
    converted for that matmul as it goes (fp8_gemm.c)."""

    def __init__(self, w13: Weight, w2: Weight, isa: str, act: ActSpec):
        if not self.usable(w13, w2) or isa not in gemm.ISAS or act[0] not in ACTS:
            raise ValueError(f"NativeMLP: {tuple(w13.shape)}, {tuple(w2.shape)} on {isa}")
        self.w13, self.w2, self.isa = w13, w2, gemm.ISAS[isa]
        self.hidden, self.inter = w2.shape
        self.act, self.limit, self.alpha = ACTS[act[0]], act[1], act[2]
        fp8 = isinstance(w13, BlockFP8)
        self.block_k = w13.block_k if fp8 else 0
        # the call's weight pointers: bf16 w13, w2 (or NULLs), then FP8 codes and scales
        self.ptrs = (None, None) if fp8 else (w13.data_ptr(), w2.data_ptr())
        self.fp8_ptrs = tuple(p for r in map(FP8Ref.of, (w13, w2)) for p in (r.q, r.s))

    @staticmethod
    def usable(w13: Weight, w2: Weight) -> bool:
        hidden, inter = w2.shape
        if all(isinstance(w, BlockFP8) for w in (w13, w2)):
            tensors = (w13.q, w13.scale, w2.q, w2.scale)
            if w13.block_k != w2.block_k:
                return False
        elif all(isinstance(w, torch.Tensor) for w in (w13, w2)):
            tensors = (w13, w2)
            if not all(w.dtype == torch.bfloat16 for w in tensors):
                return False
        else:
            return False
        return (
            gemm.available()
            and hidden % 8 == 0
            and inter % 8 == 0
            and tuple(w13.shape) == (2 * inter, hidden)
            and all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
        )

    def add_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, H] += the MLP of x [T, H] (both bf16, contiguous), rounded once; returns out."""
        T = x.shape[0]
        if T == 0:
            return out
        if not (x.is_contiguous() and out.is_contiguous()) or out.shape != x.shape:
            raise ValueError(f"NativeMLP: x {tuple(x.shape)} and out {tuple(out.shape)}")
        rc = gemm._lib().afd_bf16_mlp_add_ext(
            x.data_ptr(), *self.ptrs, out.data_ptr(), T, self.hidden, self.inter, self.act,
            self.limit, self.alpha, torch.get_num_threads(), self.isa, *self.fp8_ptrs,
            self.block_k,
        )  # fmt: skip
        if rc:
            raise RuntimeError("afd_bf16_mlp_add failed (out of memory?)")
        return out
