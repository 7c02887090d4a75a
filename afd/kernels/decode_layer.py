"""A GQA attention layer of a decode-only micro-batch in one native call (decode_layer.c): the
same kernels as the per-op path, minus ~15 Python-level calls per layer."""

from __future__ import annotations

import torch

from afd.kernels import gemm


class NativeDecodeLayer:
    """One layer's weights (bf16, contiguous, kept referenced here) for the fused call."""

    def __init__(
        self,
        attn_norm: torch.Tensor,  # [H]
        ffn_norm: torch.Tensor,  # [H]
        w_qkv: torch.Tensor,  # [(nh + 2 kvh) D, H]
        q_norm: torch.Tensor | None,  # [D]
        k_norm: torch.Tensor | None,  # [D]
        w_o: torch.Tensor,  # [H, nh D]
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
    ):
        self.tensors = [
            t.contiguous() if t is not None else None
            for t in (attn_norm, ffn_norm, w_qkv, q_norm, k_norm, w_o)
        ]
        self._ptrs = [t.data_ptr() if t is not None else None for t in self.tensors]
        self.hidden = attn_norm.shape[0]
        self.nh, self.kvh, self.d, self.eps = num_heads, num_kv_heads, head_dim, eps

    @staticmethod
    def usable(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *ws) -> bool:
        return (
            gemm.available()
            and hidden % 8 == 0
            and head_dim % 16 == 0
            and num_heads % num_kv_heads == 0
            and all(w is None or (w.dtype == torch.bfloat16 and w.device.type == "cpu") for w in ws)
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
    ) -> tuple[torch.Tensor, torch.Tensor]:  # h + attention [T, H], ffn_norm of it [T, H]
        T = h.shape[0]
        h = h.contiguous()
        h_out = torch.empty_like(h)
        x_out = torch.empty_like(h)
        _, NB, bs, _ = k_cache.shape
        blocks = blocks.contiguous()
        an, fn, wqkv, qn, kn, wo = self._ptrs
        rc = gemm._lib().afd_bf16_gqa_decode_layer(
            h.data_ptr(), h_out.data_ptr(), x_out.data_ptr(), an, fn, wqkv, qn, kn, wo,
            cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), lens.data_ptr(),
            T, self.hidden, self.nh, self.kvh, self.d, NB, bs, blocks.shape[1], self.eps,
            scale, torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"afd_bf16_gqa_decode_layer failed (lengths {lens.tolist()})")
        return h_out, x_out
