"""The attention-kind interface: how one layer projects hidden states into q, k, v."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from afd.config import ModelConfig


class AttentionKind(ABC):
    """Projects normalised hidden states into q, k, v for one layer."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int):
        self.cfg = cfg

    @abstractmethod
    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, nh, D], k [T, kvh, D], v [T, kvh, D] (before RoPE)."""

    def decode_weights(self):
        """(w_qkv [(nh + 2 kvh) D, H], q_norm [D] | None, k_norm [D] | None) where this kind is
        a fused q|k|v projection, optionally with q/k RMSNorm, then RoPE: the shape the fused
        native decode layer computes (afd/kernels/decode_layer.c). None otherwise."""
        return None
