"""Step-3 multi-matrix factorisation attention."""

from __future__ import annotations

import torch

from afd.blockfp8 import cat_rows
from afd.config import ModelConfig
from afd.kernels.decode_layer import DecodeWeights
from afd.ops import Linear, rms_norm
from services.attention.kinds.base import AttentionKind


class MFA(AttentionKind):
    """Step-3 multi-matrix factorisation attention: low-rank query, one shared K/V head."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int):
        super().__init__(cfg, w, layer)
        b = f"layers.{layer}"
        self.w_qkv = Linear(cat_rows([w.pop(f"{b}.{n}_proj") for n in "qkv"]))
        self.inter_norm = w[f"{b}.inter_norm"]
        self.wq = Linear(w.pop(f"{b}.wq"))

    def qkv(self, x):
        c = self.cfg
        q, k, v = self.w_qkv(x).split([c.q_lora_dim, c.kv_size, c.kv_size], dim=-1)
        q = self.wq(rms_norm(q, self.inter_norm, c.rms_norm_eps))  # [T, nh*D]
        return (
            q.view(-1, c.num_heads, c.head_dim),
            k.reshape(-1, c.num_kv_heads, c.head_dim),
            v.reshape(-1, c.num_kv_heads, c.head_dim),
        )

    def decode_weights(self) -> DecodeWeights | None:
        if self.w_qkv.kernel_path is None or self.wq.kernel_path is None:
            return None
        c = self.cfg
        return DecodeWeights(self.w_qkv.w, c.q_lora_dim, inter_norm=self.inter_norm, w_q=self.wq.w)
