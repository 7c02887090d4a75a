"""The Triton kernels of afd/kernels/cuda_attention.py (which says what they compute), in a
module of their own: importing Triton takes a second and hundreds of MB, so only a process that
decodes on a CUDA device (or the interpreter's tests) imports it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def partial(
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
def merge(
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
