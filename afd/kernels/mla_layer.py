"""A DeepSeek MLA attention layer of a decode-only micro-batch in one native call
(mla_layer.c): the absorbed form of services/attention/kinds/mla.py on the same kernels, so the
same bits, minus ~30 Python-level calls a layer; DSA's (kinds/dsa.py) with its indexer's
selection too."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from afd.blockfp8 import BlockFP8
from afd.kernels import gemm
from afd.kernels import topk as topk_ties
from afd.kernels.decode_layer import Routing, cpu_bf16
from afd.kernels.fp8_gemm import FP8Ref, fp8_block
from afd.kernels.heads import HeadMatmul
from afd.kernels.indexer import Indexer, IndexerWeights

_POINTERS = (
    "attn_norm", "ffn_norm", "w_a", "q_a_norm", "w_qb", "kv_a_norm", "w_uk", "w_uv", "w_o",
    "w_router", "router_bias", "ix",
)  # fmt: skip
_SIZES = (
    "H", "qr", "nh", "dn", "dr", "r", "dv", "E", "topk", "norm", "route", "groups",
    "topk_groups",
)  # fmt: skip
# the router kinds the call computes (decode_layer.c: afd_route_rows), moe_router's names
ROUTES = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_group_topk": 2}


class MLALayer(ctypes.Structure):
    """mla_layer.c's afd_mla_layer: the same fields in the same order."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in _POINTERS]
        + [(name, ctypes.c_int64) for name in _SIZES]
        + [("eps", ctypes.c_double), ("latent_eps", ctypes.c_double), ("scaling", ctypes.c_double)]
        + [(name, FP8Ref) for name in ("f8_a", "f8_qb", "f8_o")]
        + [("bk", ctypes.c_int64)]
    )


@dataclass(frozen=True)
class MLAWeights:
    """What the MLA kind contributes to the fused layer (AttentionKind.decode_weights); the
    matmul weights laid out for one path's kernels."""

    w_a: torch.Tensor | BlockFP8  # [q_in + r + dr, H]: the query's input (rank qr, or nh (dn +
    # dr)) | kv; block-FP8 (w_qb and w_o too): converted for the path's matmul as it goes
    q_a_norm: torch.Tensor | None  # [qr], None without a query rank
    w_qb: torch.Tensor | BlockFP8 | None  # [nh (dn + dr), qr]
    kv_a_norm: torch.Tensor  # [r]
    uk: HeadMatmul  # W_UK per head, [r, dn]: q_nope -> latent space
    uv: HeadMatmul  # W_UV per head, [dv, r]: latent -> value
    qr: int  # the query rank, 0 for none
    rope_dim: int  # dr
    latent_eps: float  # the latent norms' epsilon
    isa: str  # the path the weights are laid out for
    indexer: IndexerWeights | None = None  # DSA: attention over the rows its indexer selects


class NativeMLALayer:
    """One layer's weights for the fused call (kept referenced here: the struct holds only
    their addresses)."""

    def __init__(
        self,
        attn_norm: torch.Tensor,  # [H]
        ffn_norm: torch.Tensor,  # [H]
        mw: MLAWeights,
        w_o: torch.Tensor | BlockFP8,  # [H, nh dv], laid out for mw.isa
        eps: float,
        w_router: torch.Tensor | None = None,  # [E, H] laid out for mw.isa: a bias-free router
        topk: int = 0,  # > 0: route too, as the router kind `route` (ROUTES)
        route: str = "sigmoid_group_topk",
        norm_topk: bool = False,
        router_bias: torch.Tensor | None = None,  # [E]: the kind's selection bias, if any
        groups: int = 1,  # sigmoid_group_topk: groups of experts, of which topk_groups compete
        topk_groups: int = 1,
        scaling: float = 1.0,  # on the routing weights
    ):
        if route not in ROUTES or (router_bias is not None and route == "softmax_topk"):
            raise ValueError(f"the fused MLA layer routes {tuple(ROUTES)} (softmax_topk: no bias)")
        H = attn_norm.shape[0]
        nh, r, dn = mw.uk.heads, mw.uk.n, mw.uk.k
        dv = mw.uv.n
        self.isa = gemm.ISAS[mw.isa]
        # the sizes the decode stack compares across its layers (decode_stack.py: usable);
        # GQA's q_in, kvh and d mean nothing here
        self.hidden, self.nh, self.eps, self.norm_topk = H, nh, eps, norm_topk
        self.q_in, self.kvh, self.d = 0, 1, 0
        self.rows_below = mw.uk.rows_below  # the per-op path's per-head matmuls' bound
        self.experts = w_router.shape[0] if w_router is not None else 0
        self.topk = topk if self.experts else 0
        if self.topk:
            topk_ties.trust()  # tied tokens routed in the call where it picks as torch does
        bias = router_bias.float().contiguous() if router_bias is not None else None
        self.router_bias = bias  # [E] float32: the call's own copy
        norms = (attn_norm.contiguous(), ffn_norm.contiguous(), mw.kv_a_norm.contiguous())
        q_a_norm = mw.q_a_norm.contiguous() if mw.q_a_norm is not None else None
        # DSA: the call selects each row's rows itself, from the index cache it is given
        self.indexed = mw.indexer is not None
        self.index_dim = mw.indexer.dim if mw.indexer is not None else 0
        ix = Indexer.of(mw.indexer) if mw.indexer is not None else None
        self._keep = (
            *norms, mw.w_a, q_a_norm, mw.w_qb, mw.uk, mw.uv, w_o, w_router, bias, mw.indexer, ix,
        )  # fmt: skip
        ptr = lambda t: t.data_ptr() if isinstance(t, torch.Tensor) else None  # noqa: E731
        self.block_k = fp8_block(mw.w_a, mw.w_qb, w_o) or 0
        fp8 = [FP8Ref.of(w) for w in (mw.w_a, mw.w_qb, w_o)]
        self.layer = MLALayer(
            ptr(norms[0]), ptr(norms[1]), ptr(mw.w_a), ptr(q_a_norm), ptr(mw.w_qb),
            ptr(norms[2]), mw.uk.w.data_ptr(), mw.uv.w.data_ptr(), ptr(w_o), ptr(w_router),
            ptr(bias), ctypes.addressof(ix) if ix is not None else None, H, mw.qr, nh, dn,
            mw.rope_dim, r, dv, self.experts, self.topk, int(norm_topk), ROUTES[route], groups,
            topk_groups, eps, mw.latent_eps, scaling, *fp8, self.block_k,
        )  # fmt: skip

    @staticmethod
    def usable(hidden: int, mw: MLAWeights, *ws: torch.Tensor | BlockFP8) -> bool:
        """The kernels' sizes (mla_layer.c) and bf16 weights on the CPU; w_a, w_qb, w_o (the
        last of ws) and DSA's indexer's w_q and w_k may be block-FP8 of one K-block."""
        projections = (mw.w_a, mw.w_qb, ws[-1])
        others = (mw.q_a_norm, mw.kv_a_norm, *ws[:-1])
        q_in = mw.qr or mw.uk.heads * (mw.uk.k + mw.rope_dim)
        ix = mw.indexer
        if ix is not None:  # indexer.c's sizes: the query latent it reads, its keys' width
            if not (mw.qr and ix.dim % 8 == 0 and mw.rope_dim <= ix.dim <= 256 and ix.topk > 0):
                return False
            projections += (ix.w_q, ix.w_k)  # (one K-block with the layer's, if FP8)
            others += (ix.k_norm, ix.k_bias)
        dense = [t for t in projections if not isinstance(t, BlockFP8)]
        return (
            gemm.available()
            and hidden % 8 == 0
            and mw.rope_dim % 16 == 0
            and q_in % 8 == 0
            and mw.uv.n % 8 == 0
            and (mw.qr == 0) == (mw.w_qb is None)
            and not any(isinstance(t, BlockFP8) for t in others)
            and cpu_bf16(*others, *dense)
            and fp8_block(*projections) is not None
        )

    def __call__(
        self,
        h: torch.Tensor,  # [T, H] bf16: T single-token decodes
        positions: torch.Tensor,  # [T] long
        slots: torch.Tensor,  # [T] long
        blocks: torch.Tensor,  # [T, nb] long
        lens: torch.Tensor,  # [T] long
        k_cache: torch.Tensor,  # [1, NB, bs, r + dr] bf16, contiguous: the latent rows
        v_cache: torch.Tensor,  # unused: the latent's first r values are V
        cos: torch.Tensor,  # [P, dr] bf16
        sin: torch.Tensor,
        scale: float,
        index_cache: torch.Tensor | None = None,  # [NB, bs, dim] bf16, contiguous: DSA's keys
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Routing | None]:
        """(h + attention [T, H], ffn_norm of it [T, H], router logits [T, E] bf16 or None,
        (expert ids [T, k] int32, weights [T, k] float32) or None where the caller routes),
        as NativeDecodeLayer's call. An indexed (DSA) layer writes this step's indexer keys
        into index_cache and attends over the rows it selects."""
        T = h.shape[0]
        if self.indexed != (index_cache is not None):
            raise ValueError("a DSA layer takes its index cache, and only a DSA layer does")
        h = h if h.is_contiguous() else h.contiguous()
        h_out, x_out = torch.empty_like(h), torch.empty_like(h)
        _, NB, bs, _ = k_cache.shape
        if index_cache is not None:
            dim = self.index_dim
            ok = index_cache.dtype == torch.bfloat16 and index_cache.is_contiguous()
            if not ok or tuple(index_cache.shape) != (NB, bs, dim):
                raise ValueError(f"the index cache must be bf16 [{NB}, {bs}, {dim}], contiguous")
        blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
        E, k = self.experts, self.topk
        logits = torch.empty(T, E, dtype=torch.bfloat16) if E else None
        ids = torch.empty(T, k, dtype=torch.int32) if k else None
        weights = torch.empty(T, k, dtype=torch.float32) if k else None
        rc = gemm._lib().afd_bf16_mla_decode_layer(
            ctypes.addressof(self.layer), h.data_ptr(), h_out.data_ptr(), x_out.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            k_cache.data_ptr(), index_cache.data_ptr() if index_cache is not None else None,
            blocks.data_ptr(), lens.data_ptr(), T, NB, bs, blocks.shape[1],
            scale, torch.get_num_threads(), self.isa,
            logits.data_ptr() if E else None, ids.data_ptr() if k else None,
            weights.data_ptr() if k else None,
        )  # fmt: skip
        if rc < 0:
            raise RuntimeError(f"afd_bf16_mla_decode_layer failed (lengths {lens.tolist()})")
        routing = (ids, weights) if k and rc == 0 else None  # rc 1: a tie for torch to break
        return h_out, x_out, logits, routing
