"""Small numeric building blocks shared by the attention and FFN services."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afd.kernels import gemm, norm_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; statistics in float32, the scale applied in x's dtype.
    One native call where the kernels are built (at decode sizes the torch ops below are mostly
    dispatch); the result is contiguous either way."""
    if weight.dtype == torch.bfloat16 and norm_rope.usable(x, 8):
        return norm_rope.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _can_pack() -> bool:
    """Whether oneDNN can pack a bf16 weight here. It needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT:
    on an AVX2-only CPU (e.g. some AMD EPYC VMs) the reorder raises, so try it once, tiny."""
    try:
        if not (
            torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        ):
            return False
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=torch.bfloat16), 1)
        y = torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 16, dtype=torch.bfloat16), w, None, "none", [], ""
        )
        return bool((y == 16).all())
    except Exception:  # builds without oneDNN, or a CPU it has no bf16 path for
        return False


_PACK = _can_pack()


def native_bf16() -> bool:
    """afd's own AVX2 kernels carry bf16 compute here: no oneDNN bf16 path, kernels built."""
    return not _PACK and gemm.available()


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm with bf16's result (fp32 accumulation, rounded to bf16), computed in fp32 on
    CPUs without a bf16 matmul path (where oneDNN cannot pack bf16, torch's bf16 bmm is much
    slower than converting both sides and multiplying in fp32)."""
    if _PACK or a.dtype != torch.bfloat16 or a.device.type != "cpu":
        return torch.bmm(a, b)
    return torch.bmm(a.float(), b.float()).to(a.dtype)


class Linear:
    """y = x @ W.T for a fixed weight W [N, K]. bf16 on the CPU takes the fastest path there is:

    - AVX-512 CPUs: the weight is re-laid out once for oneDNN's matmul: bit-identical to
      F.linear, and skinny decode matmuls stream the blocked weight faster than row-major;
    - AVX2-only CPUs, where oneDNN cannot pack bf16 and torch's bf16 matmul falls back to a
      scalar path far slower than fp32: afd's own kernel (afd/kernels/gemm.c), fp32
      accumulation, on the weight re-laid out once as it reads it (gemm.pack: 4 rows as one
      sequential run);
    - anything else: F.linear.
    """

    def __init__(self, w: torch.Tensor):
        self.out_features, self.in_features = w.shape
        cpu_bf16 = w.dtype == torch.bfloat16 and w.device.type == "cpu"
        self.packed = _PACK and cpu_bf16
        self.native = not self.packed and cpu_bf16 and w.shape[1] % 8 == 0 and gemm.available()
        if self.packed:
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
        else:
            self.w = gemm.pack(w) if self.native else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, None, "none", [], "")
        if self.native and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return gemm.bf16_linear(x, self.w)
        return F.linear(x, self.w)


def swiglu(x: torch.Tensor, w13: Linear, w2: Linear) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up fused: w13 [2I, H], w2 [H, I]."""
    gate, up = w13(x).chunk(2, dim=-1)  # [T, I] each
    return w2(F.silu(gate) * up)  # [T, H]
