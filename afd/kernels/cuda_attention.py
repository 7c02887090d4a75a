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
both). Without Triton, or off CUDA, `usable` is False. The kernels themselves are in
afd/kernels/triton_attention.py, imported on the first CUDA decode. With TRITON_INTERPRET=1 the
kernels run on CPU tensors through Triton's interpreter: how the tests check them without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

ENV = "AFD_CUDA_ATTENTION"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the Triton kernel takes this decode (a CUDA device, or the interpreter in tests).
    Asked of every decode on every device: it imports nothing (a CPU process never loads
    Triton)."""
    if not (q.is_cuda or _INTERPRET) or os.environ.get(ENV, "triton") == "torch":
        return False
    same = q.dtype == k_cache.dtype or k_cache.dtype == torch.float8_e4m3fn  # FP8: a scaled cache
    return same and q.dtype in _DOT and _have_triton()


_DOT = {torch.bfloat16, torch.float16, torch.float32}
# Compile options named rather than left to Triton's defaults: fused multiply-adds on (Triton's
# default so far; it announces that the default turns off in 3.10). The interpreter takes none.
COMPILE_OPTIONS = {"enable_fp_fusion": True}
_COMPILE = {} if _INTERPRET else COMPILE_OPTIONS


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
    from afd.kernels import triton_attention as kernels

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
    tiles = kvh * -(-group // consts["BLOCK_H"])
    if not splits:  # about four programs per multiprocessor, from the longest context's tiles
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = max(1, min(64, (4 * sms) // max(1, B * tiles)))
    acc = torch.empty(B * nh * splits, Dv, dtype=torch.float32, device=q.device)
    m = torch.empty(B * nh * splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    kernels.partial[(B, tiles, splits)](
        q, k_cache, v_cache, ks, vs, table, lens, acc, m, lsum,
        scale, window, group, nh, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0, table.stride(0), **consts,
        **_COMPILE,
    )  # fmt: skip
    out = torch.empty(B, nh * Dv, dtype=q.dtype, device=q.device)
    kernels.merge[(B, nh)](
        acc, m, lsum, sinks if sinks is not None else m, out, splits, nh, out.stride(0),
        **merge_constexprs(Dv, splits, sinks is not None), **_COMPILE,
    )  # fmt: skip
    return out
