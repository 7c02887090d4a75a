"""The attention side of the model: embedding, attention + KV cache, router, final norm, LM head.

Reads like the paper: h = h + attention(norm(h)); x = norm(h) goes to the FFN servers, whose
output the pipeline adds back as h = h + ffn(x).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from afd.checkpoint import load_weights
from afd.config import ModelConfig
from afd.device import CPU, place
from afd.kernels.decode_layer import NativeDecodeLayer, Routing
from afd.kernels.mla_layer import ROUTES as MLA_ROUTES
from afd.kernels.mla_layer import MLAWeights, NativeMLALayer
from afd.ops import Linear, native, rms_norm
from afd.runtime import release_load_memory
from services.attention.kinds import ATTENTION_KINDS, AttentionKind
from services.attention.kv_cache import KVCache
from services.attention.moe_router import ROUTERS
from services.attention.paged_attention import AttnMeta, latent_heads


@dataclass(frozen=True)
class AttentionLayer:
    attn_norm: torch.Tensor  # [H]
    ffn_norm: torch.Tensor  # [H]
    kind: AttentionKind
    o_proj: Linear  # [H, nh*D]
    router: Linear | None  # [E, H] on MoE layers
    router_bias: torch.Tensor | None  # [E] float32: the router kind's selection bias, if any
    # the whole layer in one call, decode-only batches (MLA: its absorbed form)
    fused: NativeDecodeLayer | NativeMLALayer | None = None


class AttentionModel:
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        weights: dict[str, torch.Tensor] | None = None,
        progress: bool = True,
        device: torch.device = CPU,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        # A dict of our own: each matmul weight is popped as its Linear takes it (the Linear
        # keeps a re-laid-out copy), so a loaded original is freed at once, not at the end.
        w = (
            dict(weights)
            if weights is not None
            else load_weights(cfg, "attention", dtype, None, progress)
        )
        place(w, device)
        self.embed_w = w["embed"]  # [V, H]
        self.lm_head = Linear(w.pop("lm_head"))  # [V, H]
        self.final_norm = w["final_norm"]
        kind = ATTENTION_KINDS[cfg.attention]
        self.layers = [
            AttentionLayer(
                attn_norm=w[f"layers.{i}.attn_norm"],
                ffn_norm=w[f"layers.{i}.ffn_norm"],
                kind=kind(cfg, w, i),
                o_proj=Linear(w.pop(f"layers.{i}.o_proj"), w.pop(f"layers.{i}.o_proj_bias", None)),
                router=Linear(w.pop(f"layers.{i}.router")) if cfg.is_moe(i) else None,
                router_bias=w.get(f"layers.{i}.router_bias"),
            )
            for i in range(cfg.num_layers)
        ]
        self.layers = [replace(lw, fused=self._fused(lw)) for lw in self.layers]
        del w
        release_load_memory()
        self.cache_layout = kind.cache_layout(cfg)  # what a token leaves in the KV cache
        self.route_fn = ROUTERS[cfg.router]

    def _fused(self, lw: AttentionLayer) -> NativeDecodeLayer | None:
        """Where afd's own kernels carry the bf16 compute (ops.native), a layer's decode runs
        as one native call: the same kernels, the same bits, ~15 fewer Python calls."""
        c, dw = self.cfg, lw.kind.decode_weights()
        # one afd kernel path for every matmul of the call (block-FP8 weights converted for it)
        isa = lw.o_proj.kernel_path
        if dw is None or not native() or isa is None:
            return None
        if isinstance(dw, MLAWeights):
            return self._fused_mla(lw, dw)
        dims = (c.num_heads, c.num_kv_heads, c.head_dim)
        norms = (lw.attn_norm, lw.ffn_norm)
        if not NativeDecodeLayer.usable(c.hidden_size, *dims, dw, *norms, lw.o_proj.w):
            return None
        r = lw.router  # its matmul joins the call where it runs on the same kernel and rule
        same = r is not None and (r.isa, r.onednn_from) == (isa, lw.o_proj.onednn_from)
        w_router = r.w if same and r.bias is None and r.w.dtype == torch.bfloat16 else None
        # the router kinds the call computes join it too (softmax-then-top-k without a bias;
        # gpt-oss's top-k-then-softmax with its bias); any other kind routes from the logits
        bias = lw.router_bias
        joins = c.router == "topk_softmax" or (c.router == "softmax_topk" and bias is None)
        return NativeDecodeLayer(
            *norms, dw, lw.o_proj.w, *dims, c.rms_norm_eps, isa, w_router,
            c.top_k if joins else 0, c.norm_topk_prob, b_o=lw.o_proj.bias,
            route=c.router if joins else "softmax_topk",
            router_bias=bias if joins and c.router == "topk_softmax" else None,
        )  # fmt: skip

    def _fused_mla(self, lw: AttentionLayer, mw: MLAWeights) -> NativeMLALayer | None:
        """MLA's absorbed decode as one native call where its attention takes the native
        kernel (latent_heads) and every matmul runs on the same path as o_proj."""
        c, o = self.cfg, lw.o_proj
        most = latent_heads()
        isa = o.kernel_path  # (block-FP8 projections: the call converts them for it)
        if isa != mw.isa or o.bias is not None or (most is not None and c.num_heads > most):
            return None
        if not NativeMLALayer.usable(c.hidden_size, mw, lw.attn_norm, lw.ffn_norm, o.w):
            return None
        r = lw.router  # its matmul joins the call where it runs on the same kernel and rule
        same = r is not None and (r.isa, r.onednn_from) == (isa, o.onednn_from)
        w_router = r.w if same and r.bias is None and r.w.dtype == torch.bfloat16 else None
        bias = lw.router_bias  # the router kinds the call computes join it too
        joins = c.router in MLA_ROUTES and (c.router != "softmax_topk" or bias is None)
        return NativeMLALayer(
            lw.attn_norm, lw.ffn_norm, mw, o.w, c.rms_norm_eps, w_router,
            topk=c.top_k if joins else 0, route=c.router if joins else "softmax_topk",
            norm_topk=c.norm_topk_prob, router_bias=bias if joins else None, groups=c.n_group,
            topk_groups=c.topk_group, scaling=c.routed_scaling_factor,
        )  # fmt: skip

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        # the decode stack copies these rows itself (stack.py: run): a change here goes there too
        return F.embedding(token_ids, self.embed_w)

    def attention_and_route(
        self, layer: int, h: torch.Tensor, meta: AttnMeta, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, H] -> (h' = h + attn(norm(h)) [T, H], the FFN input x = ffn_norm(h') [T, H],
        expert ids [T, k] int32, weights [T, k] float32; k = 0 on dense layers). On the fused
        decode path the router's matmul (and softmax-then-top-k) is part of the call."""
        fused = self._fused_call(layer, h, meta, cache)
        logits = None
        if fused is not None:
            h, x, logits, routing = fused
            if routing is not None:
                return h, x, *routing
        else:
            h, x = self._attention_ops(layer, h, meta, cache)
        if logits is None:
            return h, x, *self.route(layer, x)
        return h, x, *self.route_fn(logits, self.cfg, self.layers[layer].router_bias)

    def _fused_call(
        self, layer: int, h: torch.Tensor, meta: AttnMeta, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Routing | None] | None:
        """The layer as one native call where it applies (decode-only bf16 batches below the
        oneDNN crossover), else None."""
        lw = self.layers[layer]
        decode_only = meta.num_decode == h.shape[0] and meta.decode_blocks is not None
        ours = lw.o_proj.ours(h.shape[0])  # else oneDNN's matmuls are faster (ops.Linear)
        if lw.fused is None or not (decode_only and ours and h.dtype == torch.bfloat16):
            return None
        if h.shape[0] >= lw.fused.rows_below:  # MLA: torch's bmm from there (heads.py)
            return None
        if cache.k[layer].dtype != torch.bfloat16:  # an FP8 cache: the kernel reads bf16 only
            return None
        index = None
        if isinstance(lw.fused, NativeMLALayer) and lw.fused.indexed:  # DSA: its indexer keys
            index = cache.index[layer]
            if index.dtype != torch.bfloat16:
                return None
        cos, sin = lw.kind.rope.tables(torch.bfloat16)
        extra = {} if index is None else {"index_cache": index}
        return lw.fused(
            h, meta.positions, meta.slots, meta.decode_blocks, meta.decode_lens,
            cache.k[layer], cache.v[layer], cos, sin, lw.kind.scale, **extra,
        )  # fmt: skip

    def _attention_ops(
        self, layer: int, h: torch.Tensor, meta: AttnMeta, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h', x) op by op (prefill, mixed batches, the torch and oneDNN paths)."""
        lw = self.layers[layer]
        eps = self.cfg.rms_norm_eps
        o = lw.kind.attend(rms_norm(h, lw.attn_norm, eps), meta, cache, layer)  # [T, nh*Dv]
        h = h + lw.o_proj(o)
        return h, rms_norm(h, lw.ffn_norm, eps)

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> expert ids [T, k] int32, weights [T, k] float32 (k = 0 on dense layers)."""
        gate = self.layers[layer].router
        if gate is None:
            T, dev = x.shape[0], x.device
            ids = torch.empty(T, 0, dtype=torch.int32, device=dev)
            return ids, torch.empty(T, 0, dtype=torch.float32, device=dev)
        return self.route_fn(gate(x), self.cfg, self.layers[layer].router_bias)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V] float32
        return self.lm_head(rms_norm(h, self.final_norm, self.cfg.rms_norm_eps)).float()
