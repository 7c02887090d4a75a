"""Paged attention over the KV pool, shared by every attention kind (services/attention/kinds):
q [T, nh, Dk] against cached K [kvh, .., Dk] and V [kvh, .., Dv] (GQA with kvh | nh, MFA with
kvh = 1, MLA's latent with kvh = 1 and V a view of K's first Dv columns)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

import torch

from afd.kernels import cuda_attention, paths
from afd.kernels.attention import decode_attention, prefill_softmax
from afd.ops import bmm, bmm_in_fp32, native
from services.attention.kv_cache import gather


@dataclass(frozen=True)
class PrefillSeq:
    q_start: int  # first row of this sequence in the micro-batch
    q_len: int
    blocks: torch.Tensor  # [nb] long: the KV blocks holding positions 0..L-1, L = start + q_len
    start: int  # position of the first new token (those before it are cached)
    block_size: int

    @cached_property
    def bias(self) -> torch.Tensor:  # [q_len, nb * block_size] float32
        """0 for each new token's keys (causal), -inf elsewhere: the torch path's mask, built
        when first asked for, on the blocks' device (the native prefill reads each token's
        keys by position, DSA's selection takes each row's length; at 2,048 new tokens after
        128K cached ones this mask alone would take 1 GiB)."""
        dev, L = self.blocks.device, self.blocks.shape[0] * self.block_size
        q_pos = torch.arange(self.start, self.start + self.q_len, device=dev).unsqueeze(1)
        bias = torch.zeros(self.q_len, L, device=dev)
        return bias.masked_fill_(torch.arange(L, device=dev).unsqueeze(0) > q_pos, -torch.inf)


@dataclass(frozen=True)
class AttnMeta:
    """Batch layout of one micro-batch; built once per step by the runner, used by every layer."""

    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long: where each new token's K/V is written
    num_decode: int  # rows 0..num_decode-1 are single-token decodes
    decode_blocks: torch.Tensor | None  # [nd, nb] long: block table per decode row, padded
    prefills: tuple[PrefillSeq, ...]
    decode_lens: torch.Tensor | None = None  # [nd] long: keys each decode row attends to
    block_size: int = 0

    @cached_property
    def decode_bias(self) -> torch.Tensor | None:  # [nd, 1, nb * block_size] float32
        """0 for each decode row's keys, -inf for the table's padding: the torch path's mask,
        built when first asked for (the native kernels mask by length, and every op on a
        batch-1 step's critical path costs about what its arithmetic does)."""
        if self.decode_blocks is None or self.decode_lens is None:
            return None
        nd, nb = self.decode_blocks.shape
        dev = self.decode_blocks.device
        cols = torch.arange(nb * self.block_size, device=dev).view(1, 1, -1)
        bias = torch.zeros(nd, 1, nb * self.block_size, device=dev)
        return bias.masked_fill_(cols >= self.decode_lens.view(-1, 1, 1), float("-inf"))


def paged_attention(
    q: torch.Tensor,  # [T, nh, D], after RoPE
    k_cache: torch.Tensor,  # [kvh, NB, bs, D], already holding this step's keys
    v_cache: torch.Tensor,  # [kvh, NB, bs, Dv]
    meta: AttnMeta,
    scale: float,
    sinks: torch.Tensor | None = None,  # [nh] float32: a logit per head that takes no value
    window: int = 0,  # keys a query sees, itself included (0: every earlier one)
    k_scale: torch.Tensor | None = None,  # [kvh, NB, bs] float32 where the cache is FP8
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, nh * Dv]
    T, nh, D = q.shape
    scales = (k_scale, v_scale)
    Dv = v_cache.shape[-1]
    out = torch.empty(T, nh * Dv, dtype=q.dtype, device=q.device)
    nd = meta.num_decode
    fused = _native_bf16(q, k_cache) and Dv == D and v_cache.is_contiguous()
    # decode also reads MLA's V (the latent, K's leading columns) in place
    latent_v = v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
    if nd and (fused or (latent_v and latent_native(q, k_cache, Dv))):
        lens = meta.decode_lens
        out[:nd] = decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_blocks, lens, scale, sinks, window
        )
    elif nd and cuda_attention.usable(q, k_cache):  # reads the blocks where they lie
        out[:nd] = cuda_attention.decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_blocks, meta.decode_lens, scale, sinks, window,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    elif nd:
        assert meta.decode_bias is not None
        bias = _windowed(meta.decode_bias, meta.positions[:nd], window)
        o = _attend(q[:nd].unsqueeze(1), k_cache, v_cache, meta.decode_blocks, bias, scale, sinks,
                    scales)  # fmt: skip
        out[:nd] = o.reshape(nd, -1)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        qs = q[rows].unsqueeze(0)  # [1, n, nh, D]
        bias, visible = None, None
        if native_softmax(q):  # each token's keys: the softmax in one native pass, no mask
            hi = meta.positions[rows] + 1
            visible = ((hi - window).clamp(min=0) if window else torch.zeros_like(hi), hi)
        else:
            bias = _windowed(p.bias, meta.positions[rows], window).unsqueeze(0)
        o = _attend(qs, k_cache, v_cache, p.blocks.unsqueeze(0), bias, scale, sinks, scales,
                    visible)  # fmt: skip
        out[rows] = o.reshape(p.q_len, -1)
    return out


def _native_bf16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """afd's decode kernel can read this bf16 cache in place for q [T, nh, D]."""
    return (
        native()
        and q.dtype == k_cache.dtype == torch.bfloat16
        and q.shape[-1] % 8 == 0
        and k_cache.is_contiguous()
        and k_cache.device.type == "cpu"
    )


def native_softmax(q: torch.Tensor) -> bool:
    """afd's prefill softmax (attention.c) serves the bf16 scores of these queries: on the CPU,
    whatever the cache's dtype (an FP8 cache is gathered into q's dtype) or its V's width."""
    return native() and q.dtype == torch.bfloat16 and q.device.type == "cpu"


def latent_native(q: torch.Tensor, k_cache: torch.Tensor, dv: int) -> bool:
    """Whether afd's decode kernel reads MLA's latent (k_cache [kvh, NB, bs, D], V its leading
    dv columns) in place for the queries q [T, nh, D]: up to latent_heads() query heads a
    K/V head. DSA's selected rows (sparse_attention.py) take the same test."""
    most = latent_heads()
    return (
        _native_bf16(q, k_cache)
        and dv % 8 == 0
        and (most is None or q.shape[1] // k_cache.shape[0] <= most)
    )


def latent_heads() -> int | None:
    """The most query heads a K/V head for which MLA's decode takes the native kernel (None:
    any number). Off AMX its values pass reads the latent once for every 8 heads (4 on AVX2),
    so with many heads torch's bmm of the gathered cache is faster; on AMX the tiles read it
    once for every 16 heads, and the native kernel was the faster at every head count
    measured."""
    # scripts/bench_decode_attention.py, Intel Xeon, 2 threads, torch over native a layer on
    # amx (65d04a5; D 576, 4,096 positions): 2.95x / 2.70x / 2.28x / 1.61x at 16 / 32 / 64 /
    # 128 heads; earlier (7ae653c) 1.31-1.56x at 256 heads, 1.43-2.57x at 128 from 64 to 16,384
    # positions. Off AMX: an earlier harness's figures (docs/benchmarks.md), not re-measured on
    # the CPUs that take those paths by default.
    return None if paths.active().name == "amx" else 32


# The most bytes a tile of a prefill's scores takes: a long prompt's scores are computed, turned
# into probabilities and multiplied by V a tile of query rows at a time in one reused buffer, so
# they need not fit in memory whole (at 2,048 new tokens after 32K cached ones, 64 heads'
# would take 8 GiB) and are not mapped and faulted in anew at every call.
_TILE_BYTES = 64 << 20
_tile = threading.local()  # each thread's buffer for its tiles' scores, kept while it lives


def _tile_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat tensor of at least `numel` elements of like's dtype and device, the same one at
    the thread's next call where it is large enough (it only grows). Made outside inference
    mode: written in place both in and out of it (the engine runs in it, callers may not)."""
    buf = getattr(_tile, "buf", None)
    if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
        with torch.inference_mode(False):
            buf = _tile.buf = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def causal_tiles(
    lo: torch.Tensor,  # [n]: row i sees keys lo[i] .. hi[i] - 1, neither decreasing with i
    hi: torch.Tensor,  # [n]
    keys: int,  # the keys gathered for the prefill (hi[n - 1] <= keys)
    row_bytes: int,  # bytes a query row's scores take per key (heads x the scores' width)
) -> list[tuple[slice, slice]]:
    """Tiles of one prefill's query rows and the keys each tile multiplies: no tile's scores
    take more than _TILE_BYTES (a tile holds one row at least). A tile whose first row sees
    from key 0 on takes every key (a prefix of the keys would be copied whole for each tile's
    batched matmul, which costs more than the masked keys' products); a tile of windowed rows
    takes the keys from its first row's first to its last row's last."""
    los, his = lo.tolist(), hi.tolist()
    tiles, i0, n = [], 0, len(his)
    while i0 < n:
        first = los[i0]
        if first == 0:  # every key: as many rows as the budget holds
            i1 = min(n, i0 + max(1, _TILE_BYTES // (keys * row_bytes)))
        else:
            i1 = i0 + 1
            while i1 < n and (i1 + 1 - i0) * (his[i1] - first) * row_bytes <= _TILE_BYTES:
                i1 += 1
        tiles.append((slice(i0, i1), slice(first, keys if first == 0 else his[i1 - 1])))
        i0 = i1
    return tiles


def causal_attention(
    q: torch.Tensor,  # [kvh, g, n, D] bf16: one sequence's n query rows, g a K/V head
    k: torch.Tensor,  # [kvh, L, D] bf16
    v: torch.Tensor,  # [kvh, L, Dv] bf16
    lo: torch.Tensor,  # [n] long: row i sees keys lo[i] .. hi[i] - 1
    hi: torch.Tensor,  # [n] long
    scale: float,
    sinks: torch.Tensor | None = None,  # [kvh * g] float32
) -> torch.Tensor:  # [kvh, g, n, Dv]
    """One prefill's softmax attention on afd's CPU kernels, a tile of rows at a time
    (causal_tiles): the scores' batched matmul into the thread's tile buffer, the native
    softmax over each row's keys in place, the values' batched matmul."""
    kvh, g, n, D = q.shape
    L, Dv = k.shape[1], v.shape[-1]
    o = torch.empty(kvh, g, n, Dv, dtype=q.dtype, device=q.device)
    if bmm_in_fp32(q):  # K and V converted once for every tile, not once a tile
        k, v = k.float(), v.float()
    for i, keys in causal_tiles(lo, hi, L, kvh * g * q.element_size()):
        c, nk = i.stop - i.start, keys.stop - keys.start
        s = _tile_buffer(kvh * g * c * nk, q).view(kvh, g * c, nk)
        bmm(q[:, :, i].reshape(kvh, g * c, D), k[:, keys].transpose(1, 2), out=s)
        prefill_softmax(s, lo[i] - keys.start, hi[i] - keys.start, scale, sinks, out=s)
        o[:, :, i] = bmm(s, v[:, keys]).view(kvh, g, c, Dv)
    return o


def _windowed(bias: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """A mask [rows, ..., L] with the keys at or before position - window also hidden (the
    gathered key j is position j of the row's sequence)."""
    if not window:
        return bias
    L = bias.shape[-1]
    first = (positions - window + 1).view(-1, *([1] * (bias.dim() - 1)))  # first visible key
    return bias.masked_fill(torch.arange(L, device=bias.device) < first, -torch.inf)


def _attend(
    q: torch.Tensor,  # [B, n, nh, D]
    k_cache: torch.Tensor,  # [kvh, NB, bs, D]
    v_cache: torch.Tensor,  # [kvh, NB, bs, Dv]
    blocks: torch.Tensor,  # [B, nb] long: each sequence's block table (padded)
    bias: torch.Tensor | None,  # [B, n or 1, L] float32, L = nb * bs: 0 visible, -inf masked
    # (None where `visible` gives the keys)
    scale: float,
    sinks: torch.Tensor | None = None,  # [nh] float32
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),  # an FP8 cache's
    visible: tuple[torch.Tensor, torch.Tensor] | None = None,  # [n] each token's keys lo..hi-1
) -> torch.Tensor:  # [B, n, nh, Dv]
    """Softmax attention as batched matmuls over (K/V head, sequence) pairs; the g query heads
    of a K/V head and the n query tokens of a sequence share one matmul."""
    B, n, nh, D = q.shape
    kvh, _, bs, _ = k_cache.shape
    Dv = v_cache.shape[-1]
    L = blocks.shape[1] * bs
    g = nh // kvh
    # One gather of whole blocks per cache: [kvh, B*nb, bs, D] is already [kvh*B, L, D] (an
    # FP8 cache's blocks dequantized to q's dtype as they are gathered).
    idx = blocks.reshape(-1)
    k = gather(k_cache, scales[0], 1, idx, q.dtype).view(kvh * B, L, D)
    if v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride():
        v = k[..., :Dv]  # V is K's leading columns (MLA's latent): gathered once
    else:
        v = gather(v_cache, scales[1], 1, idx, q.dtype).view(kvh * B, L, Dv)
    if visible is not None:  # one sequence (B = 1), bf16 on afd's CPU kernels: attention.c
        qh = q.view(n, kvh, g, D).permute(1, 2, 0, 3)  # [kvh, g, n, D]
        o = causal_attention(qh, k, v, visible[0], visible[1], scale, sinks)  # [kvh, g, n, Dv]
        return o.permute(2, 0, 1, 3).reshape(B, n, nh, Dv)
    qg = q.view(B, n, kvh, g, D).permute(2, 0, 3, 1, 4).reshape(kvh * B, g * n, D)
    # one pass for the fp32 upcast, the scale and the mask: bias + scale * s is scale * s
    # rounded once (bias is 0) or -inf, as the three separate ops give it
    scores = bmm(qg, k.transpose(1, 2)).view(kvh, B, g, n, L)
    scores = torch.add(bias.view(1, B, 1, -1, L), scores, alpha=scale)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink joins each softmax's denominator and takes no value
        sink = sinks.float().view(kvh, 1, g, 1, 1).expand(kvh, B, g, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :L].contiguous()
    o = bmm(probs.to(q.dtype).view(kvh * B, g * n, L), v)  # [kvh*B, g*n, Dv]
    return o.view(kvh, B, g, n, Dv).permute(1, 3, 0, 2, 4).reshape(B, n, nh, Dv)
