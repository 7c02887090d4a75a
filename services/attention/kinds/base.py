"""The attention-kind interface: how one layer projects hidden states into q, k, v."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from afd.config import ModelConfig
from afd.kernels.decode_layer import DecodeWeights


class AttentionKind(ABC):
    """Projects normalised hidden states into q, k, v for one layer."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int):
        self.cfg = cfg

    @abstractmethod
    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, nh, D], k [T, kvh, D], v [T, kvh, D] (before RoPE)."""

    def decode_weights(self) -> DecodeWeights | None:
        """This kind's weights for the fused native decode layer (afd/kernels/decode_layer.c),
        where its projections run on afd's own kernels; None keeps the per-op path."""
        return None
