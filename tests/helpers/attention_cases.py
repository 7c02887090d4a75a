"""Decode-attention cases for afd's CUDA kernel (afd/kernels/cuda_attention.py) and the torch
path's answer to each: run by Triton's interpreter on the CPU (tests/helpers/triton_interpret.py)
and on a GPU (tests/gpu)."""

from __future__ import annotations

import torch

from afd.kernels import cuda_attention
from afd.quant import quantize_fp8
from services.attention.paged_attention import _attend, _windowed

# (name, kv heads, q heads, D, Dv, block size, rows, dtype, sinks, window, V a view of K, FP8 cache)
CASES = [
    ("gqa-fp32", 2, 8, 64, 64, 4, 3, torch.float32, False, 0, False, False),
    ("mfa-bf16", 1, 16, 256, 256, 16, 2, torch.bfloat16, False, 0, False, False),
    ("gpt-oss-bf16", 2, 8, 64, 64, 4, 3, torch.bfloat16, True, 5, False, False),
    ("mla-fp32", 1, 4, 72, 64, 4, 2, torch.float32, False, 0, True, False),
    ("tiny-head-fp32", 2, 4, 8, 8, 4, 2, torch.float32, True, 3, False, False),
    ("gqa-fp8kv-bf16", 2, 8, 64, 64, 4, 3, torch.bfloat16, True, 5, False, True),
    ("mla-fp8kv-fp32", 1, 4, 72, 64, 4, 2, torch.float32, False, 0, True, True),
]


def reference(q, k_cache, v_cache, table, lens, scale, sinks, window, scales=(None, None)):
    """The torch path's decode (paged_attention's), in float32 -> [B, nh * Dv]."""
    B, bs = q.shape[0], k_cache.shape[2]
    L = table.shape[1] * bs
    cols = torch.arange(L).view(1, 1, -1)
    bias = torch.zeros(B, 1, L).masked_fill_(cols >= lens.view(-1, 1, 1), float("-inf"))
    bias = _windowed(bias, lens - 1, window)
    if scales[0] is None:
        k_cache, v_cache = k_cache.float(), v_cache.float()
    o = _attend(q.float().unsqueeze(1), k_cache, v_cache, table, bias, scale, sinks, scales)
    return o.reshape(B, -1)


def _fp8(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[kvh, NB, bs, D] values -> the FP8 pool and its [kvh, NB, bs] scales (KVCache's codec)."""
    q, s = quantize_fp8(pool.reshape(-1, pool.shape[-1]))
    return q.view(pool.shape), s.view(pool.shape[:-1])


def errors(seed: int = 0, device: str = "cpu") -> dict[str, float]:
    """Each case's relative error, the kernel against the torch path in float32."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, kvh, nh, D, Dv, bs, B, dtype, sinks, window, v_in_k, fp8 in CASES:
        NB = 64  # contexts up to 150 keys: several tiles of keys per split
        k_cache = torch.randn(kvh, NB, bs, D, generator=g).to(dtype)
        v_cache = torch.randn(kvh, NB, bs, Dv, generator=g).to(dtype)
        scales = (None, None)
        if fp8:  # each (head, token) row as the cache stores it: e4m3 and a float32 scale
            (k_cache, ks), (v_cache, vs) = _fp8(k_cache), _fp8(v_cache)
            scales = (ks, ks if v_in_k else vs)
        if v_in_k:
            v_cache = k_cache[..., :Dv]
        lens = torch.randint(1, min(150, NB * bs), (B,), generator=g)
        nb = int((lens.max() + bs - 1) // bs)
        table = torch.stack([torch.randperm(NB, generator=g)[:nb] for _ in range(B)])
        q = torch.randn(B, nh, D, generator=g).to(dtype)
        sk = torch.randn(nh, generator=g) if sinks else None
        want = reference(q, k_cache, v_cache, table, lens, D**-0.5, sk, window, scales)
        on = [t.to(device) if t is not None else None for t in (q, k_cache, table, lens, sk)]
        v_on = on[1][..., :Dv] if v_in_k else v_cache.to(device)
        s_on = [t.to(device) if t is not None else None for t in scales]
        if v_in_k:
            s_on[1] = s_on[0]
        for splits in (1, 3):
            got = cuda_attention.decode_attention(
                on[0], on[1], v_on, on[2], on[3], D**-0.5, on[4], window, splits=splits,
                k_scale=s_on[0], v_scale=s_on[1],
            )  # fmt: skip
            err = ((got.float().cpu() - want).norm() / want.norm()).item()
            out[f"{name}/splits={splits}"] = err
    return out
