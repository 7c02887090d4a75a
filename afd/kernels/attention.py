"""Paged decode attention in one native call (afd_bf16_decode_attention in attention.c): reads
K/V blocks in place where the torch path gathers them into a copy and converts it to fp32. On
the AVX-512 BF16 and AMX kernel paths its products take AVX-512 BF16 (attention512.c)."""

from __future__ import annotations

import torch

from afd.kernels import gemm, paths


def decode_attention(
    q: torch.Tensor,  # [B, nh, D] bf16: one query token per sequence, after RoPE
    k_cache: torch.Tensor,  # [kvh, NB, bs, D] bf16, holding this step's keys
    # [kvh, NB, bs, Dv] bf16: a cache of its own (Dv == D), or K's leading Dv columns (MLA's
    # latent: a view of k_cache, its rows D apart)
    v_cache: torch.Tensor,
    blocks: torch.Tensor,  # [B, nb] long: block table per sequence, padded
    lens: torch.Tensor,  # [B] long: positions 0..len-1 of each sequence are attended
    scale: float,
    sinks: torch.Tensor | None = None,  # [nh] float32: a logit per head that takes no value
    window: int = 0,  # > 0: only each sequence's last `window` positions are attended
) -> torch.Tensor:  # [B, nh * Dv] bf16
    B, nh, D = q.shape
    kvh, NB, bs, _ = k_cache.shape
    Dv = v_cache.shape[-1]
    if not k_cache.is_contiguous() or v_cache.stride() != k_cache.stride():
        raise ValueError("decode_attention: V must be a cache shaped as K, or K's leading columns")
    if Dv != D and v_cache.data_ptr() != k_cache.data_ptr():
        raise ValueError(f"decode_attention: V of width {Dv} must be K's leading columns")
    q = q.contiguous()
    blocks = blocks.contiguous()
    lens = lens.contiguous()
    out = torch.empty(B, nh * Dv, dtype=torch.bfloat16)
    sinks = None if sinks is None else sinks.float().contiguous()
    rc = gemm._lib().afd_bf16_decode_attention_ext(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        blocks.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        B,
        kvh,
        nh // kvh,
        D,
        Dv,
        NB,
        bs,
        blocks.shape[1],
        scale,
        None if sinks is None else sinks.data_ptr(),
        window,
        torch.get_num_threads(),
        paths.isa(),
    )
    if rc:
        raise RuntimeError(f"afd_bf16_decode_attention failed (lengths {lens.tolist()})")
    return out


def prefill_softmax(
    s: torch.Tensor,  # [kvh, g * n, L] bf16: one sequence's q . k, rows (head, query head, token)
    lo: torch.Tensor,  # [n] int32: token i sees keys lo[i] .. hi[i] - 1
    hi: torch.Tensor,  # [n] int32
    scale: float,
    sinks: torch.Tensor | None = None,  # [kvh * g] float32: a logit per head that takes no value
    out: torch.Tensor | None = None,  # where to write them, contiguous (s itself: in place)
) -> torch.Tensor:  # [kvh, g * n, L] bf16: the probabilities, 0 outside each row's keys
    """softmax(scale * s) over each row's visible keys only, rounded to bf16 (attention.c: a
    row is read whole before it is written, so `out` may be s)."""
    kvh, gn, L = s.shape
    n = lo.shape[0]
    s = s.contiguous()
    lo, hi = lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    if out is not None and not (out.shape == s.shape and out.dtype == s.dtype):
        raise ValueError(f"prefill_softmax: out {tuple(out.shape)} is not shaped as s")
    if out is not None and not out.is_contiguous():
        raise ValueError("prefill_softmax: out must be contiguous")
    p = torch.empty_like(s) if out is None else out
    rc = gemm._lib().afd_bf16_prefill_softmax(
        s.data_ptr(), kvh, gn // n, n, L, lo.data_ptr(), hi.data_ptr(), scale,
        None if sinks is None else sinks.data_ptr(), p.data_ptr(), torch.get_num_threads(),
        paths.isa(),
    )  # fmt: skip
    if rc:
        raise RuntimeError(f"afd_bf16_prefill_softmax failed for scores {tuple(s.shape)}")
    return p
