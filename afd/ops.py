"""Small numeric building blocks shared by the attention and FFN services."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; statistics in float32, the scale applied in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up fused: w13 [2I, H], w2 [H, I]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [T, I] each
    return F.linear(F.silu(gate) * up, w2)  # [T, H]
