"""Paged decode attention for CUDA devices, in Triton: one query row per sequence against its
blocks of the KV pool, read where they lie (no gathered copy of the context, which the torch
path makes: twice the bytes of a memory-bound step).

Each program takes one sequence, one K/V head and a tile of that head's query heads (GQA, MFA,
MLA's latent with V a view of K's first columns), walks a split of the sequence's keys in tiles
read through the block table, and keeps a running max, denominator and weighted sum of values
(the online softmax); a second kernel merges the splits, adds the sink logit (gpt-oss) to each
denominator and divides. Scores and sums are float32; the result is rounded once to q's dtype.
Keys before position - window + 1 are skipped (sliding windows). bf16 operands multiply on the
matrix units with float32 sums; float32 operands in full float32 (not tf32).

AFD_CUDA_ATTENTION=torch keeps the torch path on CUDA (for comparison; `afd bench gpu` times
both). Without Triton, or off CUDA, `usable` is False. With TRITON_INTERPRET=1 the kernels run
on CPU tensors through Triton's interpreter: how the tests check them without a GPU.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: nothing here runs
    triton = None

ENV = "AFD_CUDA_ATTENTION"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the Triton kernel takes this decode (a CUDA device, or the interpreter in tests)."""
    if triton is None or os.environ.get(ENV, "triton") == "torch":
        return False
    same = q.dtype == k_cache.dtype or k_cache.dtype == torch.float8_e4m3fn  # FP8: a scaled cache
    return (q.is_cuda or _INTERPRET) and same and q.dtype in _DOT


_DOT = {torch.bfloat16, torch.float16, torch.float32}


if triton is not None:

    @triton.jit
    def _partial(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr,
        acc_ptr, m_ptr, l_ptr,
        scale, window, group, nh, n_split,
        sq_t, sq_h, sk_h, sk_b, sk_t, sv_h, sv_b, sv_t, ss_h, ss_b, s_table,
        D: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kh = tl.program_id(1) // tl.cdiv(group, BLOCK_H)
        h0 = (tl.program_id(1) % tl.cdiv(group, BLOCK_H)) * BLOCK_H
        split = tl.program_id(2)
        hs = h0 + tl.arange(0, BLOCK_H)  # heads within the group
        h_ok = hs < group
        heads = kh * group + hs
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(
            q_ptr + b * sq_t + heads[:, None] * sq_h + d[None, :],
            mask=h_ok[:, None] & (d[None, :] < D), other=0.0,
        )  # fmt: skip
        L = tl.load(lens_ptr + b)
        # the first key the row sees (one expression: compiled branches must agree in type)
        first = tl.where(window > 0, tl.maximum(L - window, 0), 0)
        span = tl.cdiv(tl.cdiv(L - first, n_split), BLOCK_N) * BLOCK_N
        start = first + split * span
        stop = tl.minimum(start + span, L)
        m = tl.full([BLOCK_H], -1e30, tl.float32)
        lsum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for t0 in range(start, stop, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_ok = t < stop
            blk = tl.load(table_ptr + b * s_table + t // BS, mask=t_ok, other=0)
            row = blk.to(tl.int64) * sk_b + (t % BS) * sk_t + kh * sk_h
            k = tl.load(k_ptr + row[:, None] + d[None, :],
                        mask=t_ok[:, None] & (d[None, :] < D), other=0.0)  # fmt: skip
            if FP8:  # e4m3 times its row's scale, as q's dtype (the torch path's rounding)
                srow = blk.to(tl.int64) * ss_b + (t % BS) + kh * ss_h
                ks = tl.load(ks_ptr + srow, mask=t_ok, other=0.0)
                k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
            if IEEE:  # float32 operands: full precision, not the matrix units' tf32
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t_ok[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            lsum = lsum * alpha + tl.sum(p, axis=1)
            vrow = blk.to(tl.int64) * sv_b + (t % BS) * sv_t + kh * sv_h
            v = tl.load(v_ptr + vrow[:, None] + dv[None, :],
                        mask=t_ok[:, None] & (dv[None, :] < DV), other=0.0)  # fmt: skip
            if FP8:
                vs = tl.load(vs_ptr + srow, mask=t_ok, other=0.0)
                v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
            if IEEE:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
                acc = acc * alpha[:, None] + pv
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        idx = (b.to(tl.int64) * nh + heads) * n_split + split  # [BLOCK_H]: (row, head, split)
        tl.store(m_ptr + idx, m, mask=h_ok)
        tl.store(l_ptr + idx, lsum, mask=h_ok)
        tl.store(acc_ptr + idx[:, None] * DV + dv[None, :], acc,
                 mask=h_ok[:, None] & (dv[None, :] < DV))  # fmt: skip

    @triton.jit
    def _merge(
        acc_ptr, m_ptr, l_ptr, sinks_ptr, out_ptr, n_split, nh, so_t,
        DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, SINKS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        dv = tl.arange(0, BLOCK_DV)
        base = (b.to(tl.int64) * nh + h) * n_split
        ok = sp < n_split
        ms = tl.load(m_ptr + base + sp, mask=ok, other=-1e30)
        ls = tl.load(l_ptr + base + sp, mask=ok, other=0.0)
        top = tl.max(ms, axis=0)
        if SINKS:
            sink = tl.load(sinks_ptr + h).to(tl.float32)
            top = tl.maximum(top, sink)
        w = tl.exp(ms - top)
        denom = tl.sum(ls * w, axis=0)
        if SINKS:
            denom += tl.exp(sink - top)
        acc = tl.load(acc_ptr + (base + sp)[:, None] * DV + dv[None, :],
                      mask=ok[:, None] & (dv[None, :] < DV), other=0.0)  # fmt: skip
        o = tl.sum(acc * w[:, None], axis=0) / denom
        tl.store(out_ptr + b * so_t + h * DV + dv, o.to(out_ptr.dtype.element_ty), mask=dv < DV)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def partial_constexprs(
    D: int, Dv: int, bs: int, group: int, dtype: torch.dtype, fp8: bool = False
) -> dict:
    """The compile-time shape of `_partial` for one attention shape (its tiles: 16 to 64 query
    heads, the smallest `tl.dot` takes 16; 32 keys, 16 for MLA's wide latent)."""
    return dict(
        D=D, DV=Dv, BS=bs, BLOCK_H=max(16, min(64, _pow2(group))),
        BLOCK_N=32 if max(D, Dv) <= 256 else 16,
        BLOCK_D=max(16, _pow2(D)), BLOCK_DV=max(16, _pow2(Dv)),
        # the interpreter multiplies bf16 wrongly: it takes the float32 route on the same values
        IEEE=dtype == torch.float32 or _INTERPRET,
        FP8=fp8,
    )  # fmt: skip


def merge_constexprs(Dv: int, splits: int, sinks: bool) -> dict:
    return dict(DV=Dv, BLOCK_S=_pow2(splits), BLOCK_DV=_pow2(Dv), SINKS=sinks)


def decode_attention(
    q: torch.Tensor,  # [B, nh, D]
    k_cache: torch.Tensor,  # [kvh, NB, bs, D]
    v_cache: torch.Tensor,  # [kvh, NB, bs, Dv] (may be a view of k_cache's first Dv columns)
    table: torch.Tensor,  # [B, nb] long: each row's blocks, padded
    lens: torch.Tensor,  # [B] long: keys each row attends to (its position + 1)
    scale: float,
    sinks: torch.Tensor | None = None,  # [nh]: a logit per head that takes no value
    window: int = 0,  # keys a query sees, itself included (0: all)
    splits: int = 0,  # splits of each sequence's keys (0: enough to fill the device)
    k_scale: torch.Tensor | None = None,  # [kvh, NB, bs] float32 where the cache is FP8
    v_scale: torch.Tensor | None = None,  # the same layout (K's own where V lives in K)
) -> torch.Tensor:  # [B, nh * Dv]
    assert triton is not None
    B, nh, D = q.shape
    kvh, _, bs, _ = k_cache.shape
    Dv = v_cache.shape[-1]
    group = nh // kvh
    q = q.contiguous()
    table = table.contiguous()
    lens = lens.contiguous()
    fp8 = k_scale is not None
    consts = partial_constexprs(D, Dv, bs, group, q.dtype, fp8)
    ks = k_scale if fp8 else lens  # any pointer: an unused argument
    vs = v_scale if fp8 else lens
    tiles = kvh * triton.cdiv(group, consts["BLOCK_H"])
    if not splits:  # about four programs per multiprocessor, from the longest context's tiles
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = max(1, min(64, (4 * sms) // max(1, B * tiles)))
    acc = torch.empty(B * nh * splits, Dv, dtype=torch.float32, device=q.device)
    m = torch.empty(B * nh * splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    _partial[(B, tiles, splits)](
        q, k_cache, v_cache, ks, vs, table, lens, acc, m, lsum,
        scale, window, group, nh, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0, table.stride(0), **consts,
    )  # fmt: skip
    out = torch.empty(B, nh * Dv, dtype=q.dtype, device=q.device)
    _merge[(B, nh)](
        acc, m, lsum, sinks if sinks is not None else m, out, splits, nh, out.stride(0),
        **merge_constexprs(Dv, splits, sinks is not None),
    )  # fmt: skip
    return out
