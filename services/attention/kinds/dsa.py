"""DeepSeek Sparse Attention (V3.2): MLA whose queries read only the tokens a lightning
indexer selects. The indexer's keys (one small head per token, its own LayerNorm, half-split
RoPE on its first rotary dims) live in a pool of their own beside the latent cache."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from afd.blockfp8 import cat_rows
from afd.config import ModelConfig
from afd.kernels import norm_rope
from afd.kernels.indexer import IndexerWeights
from afd.kernels.mla_layer import MLAWeights
from afd.ops import Linear
from services.attention.kinds.mla import MLA
from services.attention.kv_cache import CacheLayout, KVCache
from services.attention.paged_attention import AttnMeta
from services.attention.sparse_attention import IndexQuery, sparse_attention

_K_NORM_EPS = 1e-6  # the indexer's LayerNorm is built with this epsilon


class DSA(MLA):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int):
        super().__init__(cfg, w, layer)
        ix = cfg.indexer
        assert ix is not None  # ModelConfig holds attention "dsa" and its indexer together
        self.ix = ix
        b = f"layers.{layer}"
        self.w_iq = Linear(w.pop(f"{b}.index_wq"))  # [hI * Di, qr]: from the query latent
        # the indexer's key and its head weights both read x: one matmul, split after
        self.w_ik = Linear(cat_rows([w.pop(f"{b}.index_wk"), w.pop(f"{b}.index_weights")]))
        self.k_norm = (w[f"{b}.index_k_norm"], w[f"{b}.index_k_norm_bias"])

    def decode_weights(self) -> MLAWeights | None:
        """MLA's fused layer with the indexer's weights: the call selects each decode row's
        rows (indexer.c) and attends over them, as index_query and sparse_attention do here,
        where the indexer's matmuls run on the layer's path too."""
        mw = super().decode_weights()
        lins = (self.w_iq, self.w_ik)  # (block-FP8: the call converts them for the path)
        if mw is None or any(lin.kernel_path != mw.isa or lin.bias is not None for lin in lins):
            return None
        ix = self.ix
        iw = IndexerWeights(
            w_q=self.w_iq.w, w_k=self.w_ik.w, k_norm=self.k_norm[0].contiguous(),
            k_bias=self.k_norm[1].contiguous(), heads=ix.n_heads, dim=ix.head_dim,
            topk=ix.topk, norm_eps=_K_NORM_EPS,
        )  # fmt: skip
        return replace(mw, indexer=iw)

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> CacheLayout:
        m, ix = cfg.mla, cfg.indexer
        assert m is not None and ix is not None
        width = m.kv_lora_rank + m.qk_rope_head_dim
        return CacheLayout(1, width, m.kv_lora_rank, v_in_k=True, index_dim=ix.head_dim)

    def index_query(
        self, x: torch.Tensor, q_lat: torch.Tensor, meta: AttnMeta, cache: KVCache, layer: int
    ) -> IndexQuery:
        """The indexer's queries for x's rows; its keys for them written into their pool."""
        ix, dr, T = self.ix, self.m.qk_rope_head_dim, x.shape[0]
        q = self.w_iq(q_lat).view(T, ix.n_heads, ix.head_dim)
        k, weights = self.w_ik(x).split([ix.head_dim, ix.n_heads], dim=-1)
        if norm_rope.usable(k, 1):  # the fused layer's call (mla_layer.c), so the same bits
            k = norm_rope.layer_norm(k, *self.k_norm, _K_NORM_EPS)
        else:
            k = F.layer_norm(k, (ix.head_dim,), *self.k_norm, _K_NORM_EPS)
        # half-split RoPE on the first dr dims (the latent attention's pairs are interleaved)
        q_rot, k_rot = self.rope(q[..., :dr], k[:, None, :dr], meta.positions)
        q = torch.cat([q_rot, q[..., dr:]], dim=-1)
        k = torch.cat([k_rot[:, 0], k[:, dr:]], dim=-1)
        cache.write_index(layer, meta.slots, k)
        return IndexQuery(q, weights.float() * ix.n_heads**-0.5, ix.head_dim**-0.5)

    def attend(self, x: torch.Tensor, meta: AttnMeta, cache: KVCache, layer: int) -> torch.Tensor:
        q_nope, q_pe, q_lat = self.project(x, meta, cache, layer)
        q_abs = self.absorb(q_nope, q_pe)
        assert q_lat is not None  # ModelConfig requires a query latent with an indexer
        iq = self.index_query(x, q_lat, meta, cache, layer)
        r = self.m.kv_lora_rank
        o = sparse_attention(
            q_abs, iq, cache.k[layer], cache.index[layer], meta, self.ix.topk, r, self.scale,
            cache.k_scale[layer],
        )  # [T, nh * r]  # fmt: skip
        return self.values(o)
