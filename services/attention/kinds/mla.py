"""DeepSeek multi-head latent attention, with a latent KV cache and the absorbed form.

Per token per layer the cache holds the normalised KV latent [r] and the rotary key [dr]
that every head shares: one row of r + dr, where full K and V would take nh * (dn + dr + dv).
Attention runs on the latent itself: the key half of kv_b_proj is folded into each head's
query (q_nope @ W_UK: a query in latent space), so scores are one dot product with the cached
row, and the value half is applied to the attention-weighted latent afterwards (@ W_UV). The
cache is then one K/V head of width r + dr whose first r columns are also the value, which
the shared paged attention serves as it serves MQA.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from afd.blockfp8 import cat_rows, take_rows
from afd.config import ModelConfig
from afd.kernels import paths
from afd.kernels.heads import HeadMatmul
from afd.kernels.mla_layer import MLAWeights
from afd.ops import Linear, bmm, native, rms_norm
from services.attention.kinds.base import AttentionKind
from services.attention.kv_cache import CacheLayout, KVCache, gather
from services.attention.paged_attention import (
    AttnMeta,
    PrefillSeq,
    causal_attention,
    native_softmax,
    paged_attention,
)

# The latent norms are built with their module's default epsilon, not the model's rms_norm_eps
_LATENT_EPS = 1e-6
NEVER = 1 << 62


def _halves(rows: int) -> torch.Tensor:
    """Row order that turns DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3) ... into
    the halves (x0, x2, ...), (x1, x3, ...) that the half-split rotation pairs up: the same
    rotation, with the permutation paid once on the weights instead of every step."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


class MLA(AttentionKind):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int):
        super().__init__(cfg, w, layer)
        m = cfg.mla
        assert m is not None  # ModelConfig holds attention "mla" and its dims together
        self.m = m
        b, nh = f"layers.{layer}", cfg.num_heads
        dn, dr, dv, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        kv_a = w.pop(f"{b}.kv_a_proj")  # [r + dr, H]
        q = w.pop(f"{b}.q_b_proj" if m.q_lora_rank else f"{b}.q_proj")  # [nh*(dn+dr), in]
        if m.rope_interleave:  # row permutations: dense and block-FP8 weights alike
            kv_a = take_rows(kv_a, torch.cat([torch.arange(r), r + _halves(dr)]))
            head = torch.cat([torch.arange(dn), dn + _halves(dr)])  # one head's row order
            q = take_rows(q, (torch.arange(nh)[:, None] * (dn + dr) + head).flatten())
        # both down-projections read x: one matmul, split after
        if m.q_lora_rank:
            self.w_a = Linear(cat_rows([w.pop(f"{b}.q_a_proj"), kv_a]))  # [qr + r + dr, H]
            self.q_a_norm = w[f"{b}.q_a_norm"]
            self.w_qb: Linear | None = Linear(q)  # [nh*(dn+dr), qr]
            self.a_split = [m.q_lora_rank, r + dr]
        else:
            self.w_a = Linear(cat_rows([q, kv_a]))  # [nh*(dn+dr) + r + dr, H]
            self.q_a_norm, self.w_qb = None, None
            self.a_split = [nh * (dn + dr), r + dr]
        self.kv_a_norm = w[f"{b}.kv_a_norm"]
        kv_b = w.pop(f"{b}.kv_b_proj").view(nh, dn + dv, r)  # dense: the loader expands it
        self.w_uk = kv_b[:, :dn].contiguous()  # [nh, dn, r]: q_nope -> latent space
        self.w_uv = kv_b[:, dn:].transpose(1, 2).contiguous()  # [nh, r, dv]: latent -> value
        # Each head's W_UK and W_UV also on afd's kernels where they run (heads.c), laid out
        # as the path's Linear lays out a weight, taken below HeadMatmul's rows (decode
        # batches, short absorbed prefills); torch's bmm above it and in the expanded prefill
        # reads w_uk and w_uv: views of the laid-out copy where it is row-major, else a second
        # copy of kv_b_proj.
        isa = paths.active().matmul if native() else None
        uk, uv = self.w_uk.transpose(1, 2), self.w_uv.transpose(1, 2)  # W_h [r, dn], [dv, r]
        self.uk: HeadMatmul | None = None
        self.uv: HeadMatmul | None = None
        if HeadMatmul.usable(uk, isa) and HeadMatmul.usable(uv, isa):
            self.uk, self.uv = HeadMatmul(uk, isa), HeadMatmul(uv, isa)
            uk_t, uv_t = self.uk.transposed(), self.uv.transposed()
            if uk_t is not None and uv_t is not None:  # one copy of kv_b_proj, not two
                self.w_uk, self.w_uv = uk_t, uv_t
        self.out_width = nh * dv
        # From how many query rows a prefill runs expanded: per (query, key) pair the absorbed
        # form does nh(2r + dr) multiply-adds and the expanded one nh(dn + dr + dv), which
        # first pays nh r (dn + dv) per key to expand it.
        saved = nh * (2 * r + dr - (dn + dr + dv))
        self.expand_from = -(-nh * r * (dn + dv) // saved) if saved > 0 else NEVER

    def decode_weights(self) -> MLAWeights | None:
        """The fused layer's weights (afd/kernels/mla_layer.c) where every matmul of the
        absorbed form runs on one path of afd's kernels (block-FP8 projections converted for
        it), else None."""
        isa = self.w_a.kernel_path
        if self.uk is None or self.uv is None or isa is None or self.uk.isa_name != isa:
            return None
        linears = (self.w_a,) if self.w_qb is None else (self.w_a, self.w_qb)
        if any(lin.kernel_path != isa or lin.bias is not None for lin in linears):
            return None
        return MLAWeights(
            w_a=self.w_a.w, q_a_norm=self.q_a_norm, kv_a_norm=self.kv_a_norm,
            w_qb=None if self.w_qb is None else self.w_qb.w, uk=self.uk, uv=self.uv,
            qr=self.m.q_lora_rank, rope_dim=self.m.qk_rope_head_dim, latent_eps=_LATENT_EPS,
            isa=isa,
        )  # fmt: skip

    @staticmethod
    def rope_dims(cfg: ModelConfig) -> tuple[int, int]:
        m = cfg.mla
        assert m is not None
        return m.qk_rope_head_dim, m.qk_head_dim  # only the rotary part turns

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> CacheLayout:
        m = cfg.mla
        assert m is not None
        return CacheLayout(1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank, v_in_k=True)

    def attend(
        self,
        x: torch.Tensor,  # [T, H], normalised
        meta: AttnMeta,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:  # [T, nh * dv]
        q_nope, q_pe, _ = self.project(x, meta, cache, layer)
        long = [p for p in meta.prefills if p.q_len >= self.expand_from]
        short = tuple(p for p in meta.prefills if p.q_len < self.expand_from)
        if meta.num_decode or short:  # absorbed; the long prefills' rows are left unwritten
            rest = replace(meta, prefills=short)
            q_abs = self.absorb(q_nope, q_pe)
            o = self.values(
                paged_attention(
                    q_abs,
                    cache.k[layer],
                    cache.v[layer],
                    rest,
                    self.scale,
                    k_scale=cache.k_scale[layer],
                    v_scale=cache.v_scale[layer],
                )  # fmt: skip
            )
        else:
            o = torch.empty(x.shape[0], self.out_width, dtype=x.dtype, device=x.device)
        for p in long:
            rows = slice(p.q_start, p.q_start + p.q_len)
            o[rows] = self.expanded(q_nope[rows], q_pe[rows], cache.k[layer], p,
                                    meta.positions[rows], cache.k_scale[layer])  # fmt: skip
        return o

    def project(
        self, x: torch.Tensor, meta: AttnMeta, cache: KVCache, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, H] -> (q_nope [T, nh, dn], q_pe [T, nh, dr] after RoPE, the normalised query
        latent [T, qr] or None), with this step's latent and rotary key written into the
        cache."""
        m, nh, T = self.m, self.cfg.num_heads, x.shape[0]
        dn, dr, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q_in, kv = self.w_a(x).split(self.a_split, dim=-1)
        q_lat = rms_norm(q_in, self.q_a_norm, _LATENT_EPS) if self.q_a_norm is not None else None
        q = (self.w_qb(q_lat) if self.w_qb is not None else q_in).reshape(T, nh, dn + dr)
        latent = rms_norm(kv[:, :r], self.kv_a_norm, _LATENT_EPS)  # [T, r]
        q_pe, k_pe = self.rope(q[..., dn:], kv[:, None, r:], meta.positions)  # [T,nh|1,dr]
        cache.write(layer, meta.slots, torch.cat([latent[:, None], k_pe], dim=-1), None)
        return q[..., :dn], q_pe, q_lat

    def absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """Queries in latent space [T, nh, r + dr]: each head's q_nope through W_UK."""
        if self._heads(q_nope):
            T, nh, r = q_nope.shape[0], q_nope.shape[1], self.m.kv_lora_rank
            q = torch.empty(T, nh, r + q_pe.shape[-1], dtype=q_nope.dtype)
            self.uk(q_nope, out=q[..., :r])
            q[..., r:] = q_pe
            return q
        q_lat = bmm(q_nope.transpose(0, 1), self.w_uk)  # [nh, T, r]
        return torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)

    def expanded(
        self,
        q_nope: torch.Tensor,  # [n, nh, dn]
        q_pe: torch.Tensor,  # [n, nh, dr]
        pool: torch.Tensor,  # [1, NB, bs, r + dr]
        p: PrefillSeq,
        positions: torch.Tensor,  # [n] long: the query rows' positions
        pool_scale: torch.Tensor | None = None,  # [1, NB, bs] where the cache is FP8
    ) -> torch.Tensor:  # [n, nh * dv]
        """One prefill's attention the way the checkpoint was trained: its context's latents
        expanded into every head's key and value (kv_b_proj), then attention at head width
        dn + dr: fewer FLOPs than the absorbed form from `expand_from` query rows on."""
        m, nh, n = self.m, self.cfg.num_heads, q_nope.shape[0]
        r, dr = m.kv_lora_rank, m.qk_rope_head_dim
        scale = None if pool_scale is None else pool_scale[0]
        rows = gather(pool[0], scale, 0, p.blocks, q_nope.dtype).view(-1, r + dr)  # [L, r + dr]
        L = rows.shape[0]
        latent = rows[:, :r].expand(nh, L, r)
        k_nope = bmm(self.w_uk, latent.transpose(1, 2))  # [nh, dn, L]
        k = torch.cat([k_nope.transpose(1, 2), rows[:, r:].expand(nh, L, dr)], dim=-1)
        v = bmm(latent, self.w_uv)  # [nh, L, dv]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [nh, n, dn + dr]
        if not native_softmax(q):
            scores = bmm(q, k.transpose(1, 2)).float() * self.scale + p.bias  # [nh, n, L]
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            return bmm(probs, v).transpose(0, 1).reshape(n, -1)  # [n, nh * dv]
        # row i's keys 0 .. positions[i], a tile of rows at a time
        hi = positions + 1
        o = causal_attention(q.unsqueeze(1), k, v, torch.zeros_like(hi), hi, self.scale)
        o = o.squeeze(1)  # [nh, n, dv]
        return o.transpose(0, 1).reshape(n, -1)  # [n, nh * dv]

    def _heads(self, x: torch.Tensor) -> bool:
        """Whether W_UK and W_UV multiply x's rows on afd's per-head kernel (else torch's bmm);
        the fused layer (mla_layer.c) runs below the same bound."""
        uk = self.uk
        return uk is not None and x.dtype == torch.bfloat16 and x.shape[0] < uk.rows_below

    def values(self, o: torch.Tensor) -> torch.Tensor:
        """Attention-weighted latents [T, nh * r] -> each head's value [T, nh * dv]."""
        T, nh, r = o.shape[0], self.cfg.num_heads, self.m.kv_lora_rank
        if self._heads(o):
            return self.uv(o.view(T, nh, r)).view(T, -1)
        o = bmm(o.view(T, nh, r).transpose(0, 1), self.w_uv)  # [nh, T, dv]
        return o.transpose(0, 1).reshape(T, -1)
