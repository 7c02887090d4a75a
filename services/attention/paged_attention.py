"""Paged attention over the KV pool, shared by every attention kind (services/attention/kinds):
q [T, nh, Dk] against cached K [kvh, .., Dk] and V [kvh, .., Dv] (GQA with kvh | nh, MFA with
kvh = 1, MLA's latent with kvh = 1 and V a view of K's first Dv columns)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.kernels.attention import decode_attention
from afd.ops import bmm, native


@dataclass(frozen=True)
class PrefillSeq:
    q_start: int  # first row of this sequence in the micro-batch
    q_len: int
    blocks: torch.Tensor  # [nb] long: the KV blocks holding positions 0..L-1, L = start + q_len
    bias: torch.Tensor  # [q_len, nb * block_size] float32: 0 visible (causal), -inf elsewhere


@dataclass(frozen=True)
class AttnMeta:
    """Batch layout of one micro-batch; built once per step by the runner, used by every layer."""

    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long: where each new token's K/V is written
    num_decode: int  # rows 0..num_decode-1 are single-token decodes
    decode_blocks: torch.Tensor | None  # [nd, nb] long: block table per decode row, padded
    decode_bias: torch.Tensor | None  # [nd, 1, nb * block_size] float32: 0 valid, -inf padding
    prefills: tuple[PrefillSeq, ...]
    decode_lens: torch.Tensor | None = None  # [nd] long: keys each decode row attends to


def paged_attention(
    q: torch.Tensor,  # [T, nh, D], after RoPE
    k_cache: torch.Tensor,  # [kvh, NB, bs, D], already holding this step's keys
    v_cache: torch.Tensor,  # [kvh, NB, bs, Dv]
    meta: AttnMeta,
    scale: float,
) -> torch.Tensor:  # [T, nh * Dv]
    T, nh, D = q.shape
    Dv = v_cache.shape[-1]
    out = torch.empty(T, nh * Dv, dtype=q.dtype)
    nd = meta.num_decode
    fused = native() and q.dtype == k_cache.dtype == torch.bfloat16 and D % 8 == 0
    fused = fused and Dv == D and k_cache.is_contiguous() and v_cache.is_contiguous()
    if nd and fused and k_cache.device.type == "cpu":
        lens = meta.decode_lens
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta.decode_blocks, lens, scale)
    elif nd:
        o = _attend(
            q[:nd].unsqueeze(1), k_cache, v_cache, meta.decode_blocks, meta.decode_bias, scale
        )
        out[:nd] = o.reshape(nd, -1)
    for p in meta.prefills:
        qs = q[p.q_start : p.q_start + p.q_len].unsqueeze(0)  # [1, n, nh, D]
        o = _attend(qs, k_cache, v_cache, p.blocks.unsqueeze(0), p.bias.unsqueeze(0), scale)
        out[p.q_start : p.q_start + p.q_len] = o.reshape(p.q_len, -1)
    return out


def _attend(
    q: torch.Tensor,  # [B, n, nh, D]
    k_cache: torch.Tensor,  # [kvh, NB, bs, D]
    v_cache: torch.Tensor,  # [kvh, NB, bs, Dv]
    blocks: torch.Tensor,  # [B, nb] long: each sequence's block table (padded)
    bias: torch.Tensor,  # [B, n or 1, L] float32, L = nb * bs: 0 visible, -inf masked
    scale: float,
) -> torch.Tensor:  # [B, n, nh, Dv]
    """Softmax attention as batched matmuls over (K/V head, sequence) pairs; the g query heads
    of a K/V head and the n query tokens of a sequence share one matmul."""
    B, n, nh, D = q.shape
    kvh, _, bs, _ = k_cache.shape
    Dv = v_cache.shape[-1]
    L = blocks.shape[1] * bs
    g = nh // kvh
    # One gather of whole blocks per cache: [kvh, B*nb, bs, D] is already [kvh*B, L, D].
    k = k_cache.index_select(1, blocks.reshape(-1)).view(kvh * B, L, D)
    if v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride():
        v = k[..., :Dv]  # V is K's leading columns (MLA's latent): gathered once
    else:
        v = v_cache.index_select(1, blocks.reshape(-1)).view(kvh * B, L, Dv)
    qg = q.view(B, n, kvh, g, D).permute(2, 0, 3, 1, 4).reshape(kvh * B, g * n, D)
    scores = bmm(qg, k.transpose(1, 2)).float().view(kvh, B, g, n, L) * scale
    probs = torch.softmax(scores + bias.view(1, B, 1, -1, L), dim=-1)
    o = bmm(probs.to(q.dtype).view(kvh * B, g * n, L), v)  # [kvh*B, g*n, Dv]
    return o.view(kvh, B, g, n, Dv).permute(1, 3, 0, 2, 4).reshape(B, n, nh, Dv)
