"""DeepSeek Sparse Attention over the paged pools: per query row, the lightning indexer scores
every earlier token from the indexer's own key pool, and the attention then reads only the
`topk` best tokens' latent rows (gathered by slot), never the whole context.

Rows come in groups that share a layout (afd's micro-batch: the decode rows, each with its
own block table, then each prefill sequence, its rows sharing one); a group's causal mask is
the bias the batch builder already made for dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.kernels import indexer
from afd.kernels.attention import decode_attention
from afd.ops import bmm
from services.attention.kv_cache import gather
from services.attention.paged_attention import AttnMeta, latent_native

# Rows of one prefill scored at once: rows x index heads x context stays under this many
# float32 scores.
_SCORES_PER_CHUNK = 1 << 24


@dataclass(frozen=True)
class IndexQuery:
    """The indexer's side of a micro-batch: per row, its query heads and their weights."""

    q: torch.Tensor  # [T, hI, Di], after RoPE
    weights: torch.Tensor  # [T, hI] float32, the head weights (already scaled by hI^-0.5)
    scale: float  # Di^-0.5


def select(
    iq: IndexQuery,
    rows: slice,
    index_pool: torch.Tensor,  # [NB, bs, Di]
    blocks: torch.Tensor,  # [G, nb] long, G = 1 (rows share it) or the number of rows
    lens: torch.Tensor,  # [n] long: row i sees its table's first lens[i] positions (causal)
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # slots [n, k] long, visible [n, k] bool
    """The `topk` (or fewer, in a shorter context) best-scoring visible tokens of each row:
    score = sum over heads of weight * relu(scale * q . k), as the indexer defines it. A row
    that sees no more than topk tokens keeps them all (unscored on the CPU where every row
    does). On afd's kernels the selection is indexer.c's rule (ties at the cut to the lower
    positions), which the fused layer (mla_layer.c) selects by too; torch's topk breaks ties
    its own way."""
    G, nb = blocks.shape
    bs = index_pool.shape[1]
    L = nb * bs
    k = min(topk, L)
    table = blocks.expand(lens.shape[0], nb) if G == 1 else blocks
    # (on a device the test would cost a host sync: its torch path scores every row)
    short = lens.device.type == "cpu" and int(lens.max()) <= k
    if indexer.usable(index_pool, iq.q):  # the pool read in place, one pass
        index = (
            None  # every row keeps all its positions
            if short
            else indexer.index_scores(iq.q[rows], iq.weights[rows], index_pool, blocks, iq.scale)
        )
        pos, count = indexer.topk_positions(index, k, lens, L)
        slots = table.gather(1, pos // bs) * bs + pos % bs
        return slots, torch.arange(k).unsqueeze(0) < count.unsqueeze(1)
    bias = torch.zeros(lens.shape[0], L, device=lens.device)
    bias.masked_fill_(torch.arange(L, device=lens.device) >= lens.unsqueeze(1), -torch.inf)
    if short:
        index = bias  # the scores would not change the selection
    else:
        keys = index_pool.index_select(0, blocks.reshape(-1)).view(G, L, -1).float()
        q = iq.q[rows].float()  # [n, hI, Di]
        scores = torch.relu(torch.matmul(q, keys.transpose(1, 2)) * iq.scale)  # [n, hI, L]
        index = torch.matmul(iq.weights[rows].unsqueeze(1), scores).squeeze(1) + bias  # [n, L]
    best, pos = index.topk(k, dim=-1)  # [n, k]
    slots = table.gather(1, pos // bs) * bs + pos % bs
    return slots, best > -torch.inf


def attend_selected(
    q: torch.Tensor,  # [n, nh, D]: queries in latent space
    pool: torch.Tensor,  # [NB * bs, D]: the latent rows, V their first Dv columns
    slots: torch.Tensor,  # [n, k] long
    visible: torch.Tensor,  # [n, k] bool
    dv: int,
    scale: float,
    pool_scale: torch.Tensor | None = None,  # [NB * bs] where the cache is FP8
) -> torch.Tensor:  # [n, nh * dv]
    """Each row's softmax attention over its selected rows: afd's decode kernel reading them in
    place where it takes MLA's latent (paged_attention's conditions), else a gather and
    torch's batched matmuls; the same steps and roundings, fp32 sums in another order."""
    lens = visible.sum(-1)
    k = pool.view(1, -1, 1, pool.shape[-1])  # the rows as one-row blocks of one K/V head
    if pool_scale is None and latent_native(q, k, dv) and bool((lens > 0).all()):
        # each row's visible ones first, in the pool's order (topk gives them by score; in
        # order, a run of rows in one block is read as one)
        table = slots.masked_fill(~visible, pool.shape[0]).sort(dim=-1).values
        return decode_attention(q, k, k[..., :dv], table, lens, scale)
    rows = gather(pool, pool_scale, 0, slots.reshape(-1), q.dtype).view(*slots.shape, -1)
    scores = bmm(q, rows.transpose(1, 2)).float() * scale  # [n, nh, k]
    scores = scores.masked_fill(~visible.unsqueeze(1), -torch.inf)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return bmm(probs, rows[..., :dv]).reshape(q.shape[0], -1)  # [n, nh * dv]


def sparse_attention(
    q: torch.Tensor,  # [T, nh, D], queries in latent space, after RoPE
    iq: IndexQuery,
    latent_pool: torch.Tensor,  # [1, NB, bs, D], already holding this step's rows
    index_pool: torch.Tensor,  # [NB, bs, Di], already holding this step's keys
    meta: AttnMeta,
    topk: int,
    dv: int,
    scale: float,
    latent_scale: torch.Tensor | None = None,  # [1, NB, bs] where the cache is FP8
) -> torch.Tensor:  # [T, nh * dv]
    T, nh, D = q.shape
    pool = latent_pool.view(-1, D)  # [NB * bs, D]
    pool_scale = None if latent_scale is None else latent_scale.reshape(-1)
    out = torch.empty(T, nh * dv, dtype=q.dtype, device=q.device)
    nd = meta.num_decode
    if nd:
        assert meta.decode_blocks is not None and meta.decode_lens is not None
        blocks, lens = meta.decode_blocks, meta.decode_lens
        slots, vis = select(iq, slice(0, nd), index_pool, blocks, lens, topk)
        out[:nd] = attend_selected(q[:nd], pool, slots, vis, dv, scale, pool_scale)
    for p in meta.prefills:
        L = p.blocks.shape[0] * p.block_size
        step = max(1, _SCORES_PER_CHUNK // (L * iq.q.shape[1]))
        for a in range(0, p.q_len, step):
            b = min(p.q_len, a + step)
            rows = slice(p.q_start + a, p.q_start + b)
            seen = torch.arange(p.start + a + 1, p.start + b + 1, device=p.blocks.device)
            slots, vis = select(iq, rows, index_pool, p.blocks.unsqueeze(0), seen, topk)
            out[rows] = attend_selected(q[rows], pool, slots, vis, dv, scale, pool_scale)
    return out
