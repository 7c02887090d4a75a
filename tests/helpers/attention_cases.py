"""Decode-attention cases for afd's CUDA kernel (afd/kernels/cuda_attention.py) and the torch
path's answer to each: run by Triton's interpreter on the CPU (tests/helpers/triton_interpret.py)
and on a GPU (tests/gpu)."""

from __future__ import annotations

import torch

from afd.kernels import cuda_attention
from services.attention.paged_attention import _attend, _windowed

# (name, kv heads, q heads, D, Dv, block size, rows, dtype, sinks, window, V a view of K)
CASES = [
    ("gqa-fp32", 2, 8, 64, 64, 4, 3, torch.float32, False, 0, False),
    ("mfa-bf16", 1, 16, 256, 256, 16, 2, torch.bfloat16, False, 0, False),
    ("gpt-oss-bf16", 2, 8, 64, 64, 4, 3, torch.bfloat16, True, 5, False),
    ("mla-fp32", 1, 4, 72, 64, 4, 2, torch.float32, False, 0, True),
    ("tiny-head-fp32", 2, 4, 8, 8, 4, 2, torch.float32, True, 3, False),
]


def reference(q, k_cache, v_cache, table, lens, scale, sinks, window) -> torch.Tensor:
    """The torch path's decode (paged_attention's), in float32."""
    B, bs = q.shape[0], k_cache.shape[2]
    L = table.shape[1] * bs
    cols = torch.arange(L).view(1, 1, -1)
    bias = torch.zeros(B, 1, L).masked_fill_(cols >= lens.view(-1, 1, 1), float("-inf"))
    bias = _windowed(bias, lens - 1, window)
    o = _attend(q.float().unsqueeze(1), k_cache.float(), v_cache.float(), table, bias, scale, sinks)
    return o.reshape(B, -1)


def errors(seed: int = 0, device: str = "cpu") -> dict[str, float]:
    """Each case's relative error, the kernel against the torch path in float32."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, kvh, nh, D, Dv, bs, B, dtype, sinks, window, v_in_k in CASES:
        NB = 64  # contexts up to 150 keys: several tiles of keys per split
        k_cache = torch.randn(kvh, NB, bs, D, generator=g).to(dtype)
        v_cache = torch.randn(kvh, NB, bs, Dv, generator=g).to(dtype)
        if v_in_k:
            v_cache = k_cache[..., :Dv]
        lens = torch.randint(1, min(150, NB * bs), (B,), generator=g)
        nb = int((lens.max() + bs - 1) // bs)
        table = torch.stack([torch.randperm(NB, generator=g)[:nb] for _ in range(B)])
        q = torch.randn(B, nh, D, generator=g).to(dtype)
        sk = torch.randn(nh, generator=g) if sinks else None
        want = reference(q, k_cache, v_cache, table, lens, D**-0.5, sk, window)
        on = [t.to(device) if t is not None else None for t in (q, k_cache, table, lens, sk)]
        v_on = on[1][..., :Dv] if v_in_k else v_cache.to(device)
        for splits in (1, 3):
            got = cuda_attention.decode_attention(
                on[0], on[1], v_on, on[2], on[3], D**-0.5, on[4], window, splits=splits
            )
            err = ((got.float().cpu() - want).norm() / want.norm()).item()
            out[f"{name}/splits={splits}"] = err
    return out
