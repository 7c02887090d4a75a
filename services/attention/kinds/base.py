"""The attention-kind interface: what one layer's attention leaves in the KV cache and how it
turns normalised hidden states into the attention output that o_proj takes."""

from __future__ import annotations

import torch

from afd.config import ModelConfig
from afd.kernels.decode_layer import DecodeWeights
from afd.kernels.mla_layer import MLAWeights
from services.attention.kv_cache import CacheLayout, KVCache
from services.attention.paged_attention import AttnMeta, paged_attention
from services.attention.rope import rope_for, yarn_softmax_scale


class AttentionKind:
    """One layer's attention. The default is the projected kind (GQA, MFA): `qkv` yields
    q [T, nh, D] and k, v [T, kvh, D], RoPE over the whole head, K and V cached per K/V head.
    A kind that caches something else (MLA's latent) overrides `cache_layout` and `attend`."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int):
        self.cfg = cfg
        dim, width = self.rope_dims(cfg)
        self.rope = rope_for(dim, cfg.rope_theta, cfg.max_position, cfg.rope_scaling)
        self.scale = width**-0.5 * yarn_softmax_scale(cfg.rope_scaling)

    @staticmethod
    def rope_dims(cfg: ModelConfig) -> tuple[int, int]:
        """(the dims RoPE rotates, the q.k width the softmax scale is taken from)."""
        return cfg.head_dim, cfg.head_dim

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> CacheLayout:
        return CacheLayout(cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, nh, D], k [T, kvh, D], v [T, kvh, D] (before RoPE)."""
        raise NotImplementedError

    def attend(
        self,
        x: torch.Tensor,  # [T, H], normalised
        meta: AttnMeta,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:  # [T, o_proj's input width]
        """Project, write this step's entries into the cache, attend over the cache."""
        q, k, v = self.qkv(x)
        q, k = self.rope(q, k, meta.positions)
        cache.write(layer, meta.slots, k, v)
        return paged_attention(
            q, cache.k[layer], cache.v[layer], meta, self.scale,
            k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer],
        )  # fmt: skip

    def decode_weights(self) -> DecodeWeights | MLAWeights | None:
        """This kind's weights for the fused native decode layer (afd/kernels/decode_layer.c;
        MLA's: mla_layer.c), where its projections run on afd's own kernels; None keeps the
        per-op path."""
        return None
