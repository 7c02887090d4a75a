"""Rotary position embedding, neox style (rotate halves), over the whole width it is given;
optionally YaRN-scaled (DeepSeek-V3, long-context Qwen3)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from afd.config import RopeScaling
from afd.device import CPU
from afd.kernels import norm_rope


@lru_cache(maxsize=8)
def rope_for(dim: int, theta: float, max_position: int, scaling: RopeScaling | None) -> Rope:
    """One table per distinct setting, shared by every layer that uses it."""
    return Rope(dim, theta, max_position, scaling)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(scaling: RopeScaling | None) -> float:
    """YaRN's correction to the attention softmax scale (DeepSeek's mscale_all_dim, squared)."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], the factor on cos/sin): high frequencies kept, low ones
    interpolated by `factor`, a linear ramp between, as the YaRN paper and transformers do."""
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(s.factor)

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times in the window
        window = s.original_max_position / (rotations * 2 * math.pi)
        return dim * math.log(window) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp  # weight of the unscaled frequency
    inv = (1.0 / (s.factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    return inv, attention


class Rope:
    def __init__(
        self, dim: int, theta: float, max_position: int, scaling: RopeScaling | None = None
    ):
        if scaling is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            attention = 1.0
        else:
            inv_freq, attention = _yarn(dim, theta, scaling)
        self.inv_freq, self.attention, self.max_position = inv_freq, attention, max_position
        # [P, D] per dtype and device asked for, built on first use: a bf16 server never holds
        # the float32 tables (twice the bytes; tens of MB at 100K+ positions)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(
        self, dtype: torch.dtype, device: torch.device = CPU
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed in float32 on the host, applied in the activations' dtype, as the HF
        # reference does; another device gets a copy of the same bits.
        key = (dtype, device)
        if key not in self._tables:
            positions = torch.arange(self.max_position, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
            cos, sin = emb.cos().mul_(self.attention), emb.sin().mul_(self.attention)
            self._tables[key] = (cos.to(device, dtype), sin.to(device, dtype))
        return self._tables[key]

    def __call__(
        self,
        q: torch.Tensor,  # [T, nh, D]
        k: torch.Tensor,  # [T, kvh, D]
        positions: torch.Tensor,  # [T] long
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_t, sin_t = self.tables(q.dtype, q.device)
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
