"""Grouped-query attention (Qwen3-MoE, Mixtral, gpt-oss)."""

from __future__ import annotations

import torch

from afd.blockfp8 import cat_rows
from afd.config import ModelConfig
from afd.kernels.decode_layer import DecodeWeights
from afd.ops import Linear, rms_norm
from services.attention.kinds.base import AttentionKind
from services.attention.paged_attention import paged_attention


class GQA(AttentionKind):
    """Grouped-query attention; Qwen3 adds an RMSNorm over each q and k head; gpt-oss adds
    biases to the projections, a sink logit per head and sliding-window layers."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int):
        super().__init__(cfg, w, layer)
        b = f"layers.{layer}"
        bias = None
        if f"{b}.q_proj_bias" in w:
            bias = torch.cat([w.pop(f"{b}.{n}_proj_bias") for n in "qkv"])
        self.w_qkv = Linear(cat_rows([w.pop(f"{b}.{n}_proj") for n in "qkv"]), bias)
        self.q_norm = w.get(f"{b}.q_norm")
        self.k_norm = w.get(f"{b}.k_norm")
        self.sinks = w.get(f"{b}.sinks")  # [nh] float32
        self.window = cfg.window(layer)

    def qkv(self, x):
        c = self.cfg
        q, k, v = self.w_qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, c.rms_norm_eps)
            k = rms_norm(k, self.k_norm, c.rms_norm_eps)
        return q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)

    def attend(self, x, meta, cache, layer):
        if self.sinks is None and not self.window:
            return super().attend(x, meta, cache, layer)
        q, k, v = self.qkv(x)
        q, k = self.rope(q, k, meta.positions)
        cache.write(layer, meta.slots, k, v)
        return paged_attention(
            q, cache.k[layer], cache.v[layer], meta, self.scale, self.sinks, self.window,
            cache.k_scale[layer], cache.v_scale[layer],
        )  # fmt: skip

    def decode_weights(self) -> DecodeWeights | None:
        if self.w_qkv.kernel_path is None:  # (a block-FP8 weight: the call converts it)
            return None
        return DecodeWeights(
            self.w_qkv.w, self.cfg.q_size, self.q_norm, self.k_norm,
            b_qkv=self.w_qkv.bias, sinks=self.sinks, window=self.window,
        )  # fmt: skip
