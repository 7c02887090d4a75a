"""Small numeric building blocks shared by the attention and FFN services."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afd.blockfp8 import BlockFP8
from afd.kernels import fp8_gemm, gemm, norm_rope, paths
from afd.mxfp4 import MXFP4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; statistics in float32, the scale applied in x's dtype.
    One native call where the kernels are built (at decode sizes the torch ops below are mostly
    dispatch); the result is contiguous either way."""
    if weight.dtype == torch.bfloat16 and norm_rope.usable(x, 8):
        return norm_rope.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def native() -> bool:
    """afd's own fused kernels (decode layer, experts, paged attention) run on this path."""
    return paths.active().native


def bmm_in_fp32(a: torch.Tensor) -> bool:
    """Whether bmm multiplies a bf16 `a` in fp32 here: on CPUs where oneDNN cannot pack bf16,
    torch's bf16 bmm is much slower than converting both sides and multiplying in fp32."""
    return a.dtype == torch.bfloat16 and a.device.type == "cpu" and not paths.onednn_bf16()


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bmm with a's dtype in the result (bf16: fp32 accumulation, rounded to bf16),
    computed in fp32 where bmm_in_fp32(a) (b may then be fp32 already: a caller reusing it
    converts it once); into `out` where given."""
    if not bmm_in_fp32(a):
        return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)
    r = torch.bmm(a.float(), b.float())
    return r.to(a.dtype) if out is None else out.copy_(r)


class Linear:
    """y = x @ W.T for a fixed weight W [N, K], on the kernel path active when it is built
    (afd/kernels/paths.py); bf16 on the CPU:

    - amx: afd's AMX kernel on W re-laid out once in tiles (gemm.pack_tiles), every batch size;
    - avx512bf16: afd's kernel on W as it is, up to the rows of x from which oneDNN's matmul
      (F.linear, same W) is faster here (paths.onednn_from_rows);
    - avx2: afd's kernel on W re-laid out once (gemm.pack), every batch size;
    - onednn: W re-laid out once for oneDNN's matmul: bit-identical to F.linear;
    - torch, and any other dtype or device: F.linear.

    A block-FP8 weight (afd/blockfp8.py) stays FP8: where afd's kernel would multiply the
    dense weight, one native call converts a chunk of rows at a time into that kernel's layout
    and multiplies it (afd/kernels/fp8_gemm.py); elsewhere each call dequantizes a run of rows
    at a time and multiplies it as the dense weight would be (oneDNN or F.linear). Either way
    the result is the dense weight's.
    An MXFP4 weight (afd/mxfp4.py) stays in 4 bits, multiplied by afd's kernel that reads it
    directly. `bias` [N], if any, is added to the result.
    """

    def __init__(self, w: torch.Tensor | BlockFP8 | MXFP4, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = w.shape
        self.bias = bias
        self.mx = w if isinstance(w, MXFP4) else None
        if self.mx is not None:
            self.fp8, self.matmul, self.isa, self.onednn_from, self.w = None, "mxfp4", None, 0, w
            return
        k = self.in_features
        self.fp8 = w if isinstance(w, BlockFP8) else None
        dense_dtype = torch.bfloat16 if self.fp8 is not None else w.dtype
        matmul = paths.active().matmul if dense_dtype == torch.bfloat16 else "torch"
        # afd's kernels need K % 8 == 0 (AVX2) or even K (AVX-512 BF16, AMX)
        device = (w.q if self.fp8 is not None else w).device
        if device.type != "cpu" or k % gemm.K_MULTIPLE.get(matmul, 1):
            matmul = "torch"
        self.matmul = matmul
        # from how many rows of x F.linear takes over (never for avx2: it has no fast bf16 path)
        threads = torch.get_num_threads()
        self.onednn_from = (
            paths.onednn_from_rows(threads) if matmul == "avx512bf16" else paths.NEVER
        )
        if self.fp8 is not None:  # no resident dense copy, so no fused layer can read it
            self.isa, self.w = None, w
            self._run_isa = matmul if matmul in gemm.ISAS else None
            return
        self.isa = matmul if matmul in gemm.ISAS else None  # afd's kernel, on this layout
        if matmul == "onednn":
            self.w = _onednn_layout(w)
        elif matmul in gemm.ISAS:
            self.w = gemm.lay_out(w, matmul)
        else:
            self.w = w

    @property
    def native(self) -> bool:
        """Its weight is laid out for afd's kernels (fused layer, fused experts)."""
        return self.isa is not None

    @property
    def kernel_path(self) -> str | None:
        """The afd kernel path whose matmul multiplies this weight: laid out for it (dense), or
        converted for it as it goes (block-FP8, fp8_gemm.c); None where oneDNN, F.linear or
        MXFP4's own kernel does."""
        return self.isa if self.fp8 is None else self._run_isa

    def ours(self, rows: int) -> bool:
        """Whether afd's kernel multiplies `rows` rows of x (below the crossover from which
        oneDNN is faster); the fused calls built on this weight follow the same rule."""
        return self.kernel_path is not None and rows < self.onednn_from

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.mx is not None:
            return self.mx.linear(x)
        if self.fp8 is not None:
            isa = self._fp8_isa(x)
            if isa is not None:
                return fp8_gemm.linear(x, self.fp8, isa)
            return self.fp8.linear(x, self._fp8_kernel(x))
        if self.matmul == "onednn":
            return _onednn_matmul(x, self.w)
        cpu_bf16 = x.dtype == torch.bfloat16 and x.device.type == "cpu"
        if cpu_bf16 and self.ours(x.numel() // self.in_features):
            return gemm.bf16_linear(x, self.w, self.isa)
        return F.linear(x, self.w)

    def _fp8_isa(self, x: torch.Tensor) -> str | None:
        """The afd kernel path that multiplies x by the FP8 weight (fp8_gemm.c): the one that
        would take the dense weight at x's rows; None where oneDNN or F.linear would."""
        isa = self._run_isa
        if isa is None or not fp8_gemm.usable(x, self.fp8, isa):
            return None
        return isa if self.ours(x.numel() // self.in_features) else None

    def _fp8_kernel(self, x: torch.Tensor):
        """How a dequantized run of rows is multiplied where afd's kernel does not take it:
        as this path multiplies a dense W."""
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and self.matmul == "onednn":
            # as the dense weight: F.linear takes other kernels for small shapes on some CPUs
            # (one bf16 ulp apart on Zen 4)
            return lambda x, w: _onednn_matmul(x, _onednn_layout(w))
        return F.linear


def _onednn_layout(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] re-laid out for oneDNN's matmul (the onednn path's weight)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)


def _onednn_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W.T by oneDNN's matmul, w = _onednn_layout(W)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def swiglu(x: torch.Tensor, w13: Linear, w2: Linear) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up fused: w13 [2I, H], w2 [H, I]."""
    gate, up = w13(x).chunk(2, dim=-1)  # [T, I] each
    return w2(F.silu(gate) * up)  # [T, H]
