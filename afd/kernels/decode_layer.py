"""An attention layer (GQA, gpt-oss's GQA with biases, sinks and windows, or MFA) of a
decode-only micro-batch in one native call (decode_layer.c): the same kernels as the per-op
path, minus ~15 Python-level calls per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.blockfp8 import BlockFP8
from afd.kernels import gemm, paths
from afd.kernels import topk as topk_ties
from afd.kernels.fp8_gemm import FP8Ref, fp8_block

Routing = tuple[torch.Tensor, torch.Tensor]  # expert ids [T, k] int32, weights [T, k] float32
ROUTES = {"softmax_topk": 0, "topk_softmax": 1}  # the router kinds the call computes


@dataclass(frozen=True)
class DecodeWeights:
    """What an attention kind contributes to the fused layer (AttentionKind.decode_weights)."""

    # the projections may be block-FP8 (the call converts them for its matmuls, fp8_gemm.c)
    w_qkv: torch.Tensor | BlockFP8  # [q_in + 2 kvh D, H]: query part, then k, then v
    q_in: int  # width of the query part: nh D, or MFA's query rank
    q_norm: torch.Tensor | None = None  # [D], per query head (Qwen3)
    k_norm: torch.Tensor | None = None  # [D]
    inter_norm: torch.Tensor | None = None  # [q_in], MFA: norm of the low-rank query
    w_q: torch.Tensor | BlockFP8 | None = None  # [nh D, q_in], MFA: its up-projection
    b_qkv: torch.Tensor | None = None  # [q_in + 2 kvh D] bf16, gpt-oss: the projections' bias
    sinks: torch.Tensor | None = None  # [nh] float32, gpt-oss: a sink logit per query head
    window: int = 0  # > 0: the keys a query sees, itself included (gpt-oss's sliding layers)


def cpu_bf16(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given (None: absent) is bf16 on the CPU: what the fused calls read."""
    return all(t is None or (t.dtype == torch.bfloat16 and t.device.type == "cpu") for t in tensors)


class NativeDecodeLayer:
    """One layer's weights (bf16, contiguous, kept referenced here) for the fused call; its
    projections (w_qkv, w_q, w_o) may be block-FP8 with one block width."""

    def __init__(
        self,
        attn_norm: torch.Tensor,  # [H]
        ffn_norm: torch.Tensor,  # [H]
        dw: DecodeWeights,
        w_o: torch.Tensor | BlockFP8,  # [H, nh D]
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        isa: str,  # the matmuls' instruction set, which the weights are laid out for
        w_router: torch.Tensor | None = None,  # [E, H] in isa's layout: a bias-free router
        topk: int = 0,  # > 0: route too, as the router kind below (decode_layer.c)
        norm_topk: bool = False,
        b_o: torch.Tensor | None = None,  # [H]: the output projection's bias (gpt-oss)
        route: str = "softmax_topk",  # or "topk_softmax" (gpt-oss), moe_router's kinds
        router_bias: torch.Tensor | None = None,  # [E] float32: topk_softmax's, on the logits
    ):
        if route not in ROUTES or (router_bias is not None and route != "topk_softmax"):
            raise ValueError(f"the fused layer routes {tuple(ROUTES)} (a bias: topk_softmax)")
        self.isa = gemm.ISAS[isa]
        ws = (attn_norm, ffn_norm, dw.w_qkv, dw.q_norm, dw.k_norm, dw.inter_norm, dw.w_q, w_o)
        self.tensors = [
            t.contiguous() if isinstance(t, torch.Tensor) else t for t in (*ws, w_router)
        ]
        self._ptrs = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in self.tensors]
        # FP8 projections: codes and scales for w_qkv, w_q, w_o (None: bf16, in _ptrs)
        self.block_k = fp8_block(dw.w_qkv, dw.w_q, w_o) or 0
        self.fp8_weights = (dw.w_qkv, dw.w_q, w_o)  # the decode stack passes their codes too
        self._fp8_ptrs = [p for r in map(FP8Ref.of, self.fp8_weights) for p in (r.q, r.s)]
        self.experts = w_router.shape[0] if w_router is not None else 0
        self.topk, self.norm_topk = (topk, norm_topk) if self.experts else (0, False)
        self.route = ROUTES[route]
        if self.topk:
            topk_ties.trust()  # tied tokens routed in the call where it picks as torch does
        # gpt-oss's additions, in the dtypes the per-op path applies them in: a Linear's bias
        # is added in the result's dtype, sinks and the router's bias in float32
        bf16 = torch.bfloat16
        self._extra = [
            t if t is None else t.to(dtype).contiguous()
            for t, dtype in ((dw.b_qkv, bf16), (b_o, bf16), (dw.sinks, torch.float32),
                             (router_bias, torch.float32))
        ]  # fmt: skip
        self._extra_ptrs = [t.data_ptr() if t is not None else None for t in self._extra]
        self.window = dw.window
        self.rows_below = paths.NEVER  # no bound of its own (o_proj's is the caller's)
        self.hidden, self.q_in = attn_norm.shape[0], dw.q_in
        self.nh, self.kvh, self.d, self.eps = num_heads, num_kv_heads, head_dim, eps

    @staticmethod
    def usable(
        hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, dw: DecodeWeights, *ws
    ) -> bool:
        # ws: the norms and w_o; the projections may be block-FP8 of one block width
        tensors = (dw.w_qkv, dw.q_norm, dw.k_norm, dw.inter_norm, dw.w_q, *ws)
        dense = [t for t in tensors if not isinstance(t, BlockFP8)]
        return (
            gemm.available()
            and hidden % 8 == 0
            and head_dim % 16 == 0
            and dw.q_in % 8 == 0
            and num_heads % num_kv_heads == 0
            and (dw.w_q is not None or dw.q_in == num_heads * head_dim)
            and cpu_bf16(*dense)
            and fp8_block(*tensors) is not None
        )

    def __call__(
        self,
        h: torch.Tensor,  # [T, H] bf16: T single-token decodes
        positions: torch.Tensor,  # [T] long
        slots: torch.Tensor,  # [T] long
        blocks: torch.Tensor,  # [T, nb] long
        lens: torch.Tensor,  # [T] long
        k_cache: torch.Tensor,  # [kvh, NB, bs, D] bf16, contiguous
        v_cache: torch.Tensor,
        cos: torch.Tensor,  # [P, D] bf16
        sin: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Routing | None]:
        """(h + attention [T, H], ffn_norm of it [T, H], router logits [T, E] bf16 or None,
        (expert ids [T, k] int32, weights [T, k] float32) or None where the caller routes)"""
        T = h.shape[0]
        h = h if h.is_contiguous() else h.contiguous()
        h_out = torch.empty_like(h)
        x_out = torch.empty_like(h)
        _, NB, bs, _ = k_cache.shape
        blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
        an, fn, wqkv, qn, kn, inn, wq, wo, wr = self._ptrs
        E, k = self.experts, self.topk  # with a router weight: its logits (with topk: routing)
        logits = torch.empty(T, E, dtype=torch.bfloat16) if E else None
        ids = torch.empty(T, k, dtype=torch.int32) if k else None
        weights = torch.empty(T, k, dtype=torch.float32) if k else None
        b_qkv, b_o, sinks, router_bias = self._extra_ptrs
        rc = gemm._lib().afd_bf16_decode_layer_ext(
            h.data_ptr(), h_out.data_ptr(), x_out.data_ptr(), an, fn, wqkv, qn, kn, inn, wq, wo,
            cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), lens.data_ptr(),
            T, self.hidden, self.q_in, self.nh, self.kvh, self.d, NB, bs, blocks.shape[1],
            self.eps, scale, torch.get_num_threads(), self.isa,
            wr if E else None, logits.data_ptr() if E else None, E, k, self.norm_topk,
            ids.data_ptr() if k else None, weights.data_ptr() if k else None,
            b_qkv, b_o, sinks, self.window, router_bias, self.route, *self._fp8_ptrs,
            self.block_k,
        )  # fmt: skip
        if rc < 0:
            raise RuntimeError(f"afd_bf16_decode_layer failed (lengths {lens.tolist()})")
        routing = (ids, weights) if k and rc == 0 else None  # rc 1: a tie for torch to break
        return h_out, x_out, logits, routing
