"""Each head's own matmul in one native call (heads.c), on the weight layout and kernels of the
path's Linear: MLA's absorbed form (q_nope through W_UK, the attention-weighted latent through
W_UV), where torch's batched matmul costs several times the matrices' read time at decode
sizes."""

from __future__ import annotations

import torch

from afd.kernels import gemm

# Rows of x from which MLA takes torch's batched matmul for W_UK and W_UV instead (and its
# decode no fused layer): the per-head calls give each thread whole heads, one at a time.
# Measured on the Intel Xeon against torch's bmm on oneDNN's AMX (docs/benchmarks.md), a
# bound that favours torch off AMX, where oneDNN has no tiles (Zen 4) or ops.bmm converts to
# fp32 (Zen 3): on amx the matmuls alone 1.1-1.4x up to 16 rows, 0.84-0.90x at 32, 0.60-1.09x
# at 128, while the fused layer and the decode stack they allow made a 32-row decode step
# 1.19x faster; avx512bf16 and avx2 1.05-1.7x at 1-4 rows (avx2 with 128 heads 0.79-0.92x),
# 0.65-0.80x at 8.
ROWS_BELOW = {"amx": 64, "avx512bf16": 8, "avx2": 8}


class HeadMatmul:
    """nh matrices W_h [N, K] bf16, laid out for path `isa`'s matmul (gemm.lay_out):
    y[t, h] = x[t, h] @ W_h^T."""

    def __init__(self, w: torch.Tensor, isa: str):  # w [nh, N, K]
        if not self.usable(w, isa):
            raise ValueError(f"HeadMatmul: {tuple(w.shape)} {w.dtype} on {isa}")
        self.heads, self.n, self.k = w.shape
        self.isa_name, self.isa = isa, gemm.ISAS[isa]
        self.rows_below = ROWS_BELOW[isa]  # callers take torch's bmm from this many rows
        self.w = torch.stack([gemm.lay_out(m, isa) for m in w])  # [nh, N, K], contiguous

    @staticmethod
    def usable(w: torch.Tensor, isa: str | None) -> bool:
        """Where the kernels take these matrices: bf16 on the CPU, whole AMX tiles (16 rows of
        32 values: DeepSeek's shapes; others keep torch's bmm) and one of afd's own matmuls."""
        return (
            isa in gemm.ISAS
            and gemm.available()
            and w.dim() == 3
            and w.dtype == torch.bfloat16
            and w.device.type == "cpu"
            and w.shape[1] % 16 == 0
            and w.shape[2] % 32 == 0
        )

    def transposed(self) -> torch.Tensor | None:
        """Each W_h^T [nh, K, N] as a view of the laid-out matrices where the path keeps them
        row-major (avx512bf16), so a caller needing them for torch's matmuls keeps no copy of
        its own; None where the layout is the path's own (packed, tiles)."""
        return self.w.transpose(1, 2) if self.isa_name == "avx512bf16" else None

    def __call__(
        self,
        x: torch.Tensor,  # [T, nh, K] bf16, last dim contiguous
        out: torch.Tensor | None = None,  # [T, nh, N] bf16, last dim contiguous, or None
    ) -> torch.Tensor:  # [T, nh, N]
        T = x.shape[0]
        if x.shape[1:] != (self.heads, self.k) or x.stride(-1) != 1:
            raise ValueError(f"HeadMatmul: x {tuple(x.shape)} for {self.heads} heads of {self.k}")
        y = torch.empty(T, self.heads, self.n, dtype=torch.bfloat16) if out is None else out
        if T == 0:
            return y
        rc = gemm._lib().afd_bf16_head_matmul(
            x.data_ptr(), x.stride(0), x.stride(1), self.w.data_ptr(), y.data_ptr(),
            y.stride(0), y.stride(1), T, self.heads, self.n, self.k,
            torch.get_num_threads(), self.isa,
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"afd_bf16_head_matmul failed for x {tuple(x.shape)}")
        return y
