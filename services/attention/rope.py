"""Rotary position embedding, neox style (rotate halves), over the whole head dim."""

from __future__ import annotations

import torch

from afd.kernels import norm_rope


class Rope:
    def __init__(self, head_dim: int, theta: float, max_position: int):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = emb.cos()
        self.sin = emb.sin()
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed in float32, applied in the activations' dtype, as the HF reference does.
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._cast[dtype]

    def __call__(
        self,
        q: torch.Tensor,  # [T, nh, D]
        k: torch.Tensor,  # [T, kvh, D]
        positions: torch.Tensor,  # [T] long
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_t, sin_t = self.tables(q.dtype)
        if norm_rope.usable(q, 16) and norm_rope.usable(k, 16):  # bit-identical, one call each
            return (
                norm_rope.rope(q, cos_t, sin_t, positions),
                norm_rope.rope(k, cos_t, sin_t, positions),
            )
        cos = cos_t.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = sin_t.index_select(0, positions).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
