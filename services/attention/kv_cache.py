"""The paged KV pool: per layer, K and V slots addressed as block_id * block_size + offset.

What a token leaves in the pool is its attention kind's business (`CacheLayout`): K and V per
K/V head (GQA, MFA), or one latent per token whose first columns double as the value (MLA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.config import CacheConfig, ModelConfig
from afd.device import CPU
from afd.quant import FP8, quantize_fp8


@dataclass(frozen=True)
class CacheLayout:
    """One token's entry in one layer's cache: `heads` rows of K [k_dim] and V [v_dim]."""

    heads: int
    k_dim: int
    v_dim: int
    # V is K's first v_dim columns (MLA: the latent is both); stored once, V is a view
    v_in_k: bool = False
    # a sparse-attention indexer's key per token (DSA), kept in a pool of its own
    index_dim: int = 0

    def bytes_per_token(self, num_layers: int, dtype: torch.dtype, fp8: bool = False) -> int:
        """One token's bytes in every layer's pool (with fp8: a byte per value and a float32
        scale per K and per V row)."""
        per_head = self.k_dim + (0 if self.v_in_k else self.v_dim)
        if not fp8:
            return num_layers * (self.heads * per_head + self.index_dim) * dtype.itemsize
        scales = 4 * (1 if self.v_in_k else 2)
        return num_layers * (self.heads * (per_head + scales) + self.index_dim * dtype.itemsize)


def num_blocks_for(
    layout: CacheLayout, cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype
) -> int:
    """Blocks in a host pool: `num_blocks` as given, else what kv_cache_memory_gb holds."""
    if cache.num_blocks:
        return cache.num_blocks
    fp8 = cache.kv_cache_dtype == "fp8"
    per_block = cache.block_size * layout.bytes_per_token(cfg.num_layers, dtype, fp8)
    return max(1, int(cache.kv_cache_memory_gb * (1 << 30)) // per_block)


@dataclass(frozen=True)
class DevicePlan:
    """How a device's memory is shared out (bytes), as vLLM's --gpu-memory-utilization reads:
    this process may hold utilization x total; the KV pool gets that less what the process
    holds already (its weights) and the activations' reserve, and never more than is free (so
    processes sharing a device, each with its share, fit)."""

    total: int
    utilization: float
    ours: int  # held by this process when the pool is planned (its weights)
    free: int  # held by no process
    activations: int  # reserve for one step's temporaries at the scheduler's bounds
    block_bytes: int

    @property
    def kv_bytes(self) -> int:
        share = int(self.total * self.utilization) - self.ours
        return min(share, self.free) - self.activations

    @property
    def num_blocks(self) -> int:
        return max(0, self.kv_bytes // self.block_bytes)

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"{self.utilization:.2f} x {self.total / gib:.1f} GiB less {self.ours / gib:.2f} GiB "
            f"of weights (at most the {self.free / gib:.2f} GiB free), less "
            f"{self.activations / gib:.2f} GiB for activations"
        )


def activation_bytes(cfg: ModelConfig, max_tokens: int, max_seqs: int, max_len: int) -> int:
    """An upper estimate of one step's temporaries: a dozen [T, H]-wide fp32 buffers per
    token, the fp32 attention scores and probabilities of a full prefill chunk against the
    longest context, and the sampled rows' fp32 logits (three copies: logits, softmax, log)."""
    per_token = 12 * max(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size) * 4
    scores = 2 * max_tokens * cfg.num_heads * max_len * 4
    logits = 3 * max_seqs * cfg.vocab_size * 4
    return max_tokens * per_token + scores + logits


class KVCache:
    def __init__(
        self,
        layout: CacheLayout,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device = CPU,
        fp8: bool = False,
    ):
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.fp8 = fp8  # K and V as e4m3 with a float32 scale per token and head (k_scale, v_scale)
        store = FP8 if fp8 else dtype
        # Heads outermost, then whole blocks: gathering a sequence's blocks copies 2-4 KiB rows
        # and yields [kvh, L, D] directly, the layout the attention matmuls read.
        kvh = layout.heads
        shape = (kvh, num_blocks, block_size)

        def pool(width: int, dt: torch.dtype = store) -> torch.Tensor:
            return torch.zeros(*shape, width, dtype=dt, device=device)

        self.k = [pool(layout.k_dim) for _ in range(num_layers)]  # [kvh, NB, bs, Dk]
        # [kvh, NB, bs, Dv]: V is K's first columns where it lives in K (MLA's latent)
        self.v = [k[..., : layout.v_dim] if layout.v_in_k else pool(layout.v_dim) for k in self.k]
        # [kvh, NB, bs] float32 per FP8 pool (None in a bf16/fp32 cache); V in K shares K's
        none: list[torch.Tensor | None] = [None] * num_layers
        self.k_scale = [pool(1, torch.float32)[..., 0] for _ in range(num_layers)] if fp8 else none
        self.v_scale = (
            self.k_scale if layout.v_in_k
            else [pool(1, torch.float32)[..., 0] for _ in range(num_layers)] if fp8 else none
        )  # fmt: skip
        self.index = [
            torch.zeros(num_blocks, block_size, layout.index_dim, dtype=dtype, device=device)
            for _ in range(num_layers if layout.index_dim else 0)
        ]

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # [T] long
        k: torch.Tensor,  # [T, kvh, Dk]
        v: torch.Tensor | None,  # [T, kvh, Dv]; None where V lives in K
    ) -> None:
        self._put(self.k[layer], self.k_scale[layer], slots, k)
        if v is not None:
            self._put(self.v[layer], self.v_scale[layer], slots, v)

    @staticmethod
    def _put(pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor):
        kvh, D = pool.shape[0], pool.shape[-1]
        rows = x.transpose(0, 1)  # [kvh, T, D]
        if scale is not None:  # per (head, token): the FP8 wire's codec, row by row
            q, s = quantize_fp8(rows.reshape(-1, D))
            scale.view(kvh, -1).index_copy_(1, slots, s.view(kvh, -1))
            # copied as bytes: PyTorch's CPU index_copy_ has no float8 kernel
            pool, rows = pool.view(torch.uint8), q.view(torch.uint8).view(kvh, -1, D)
        pool.view(kvh, -1, D).index_copy_(1, slots, rows)

    def write_index(
        self,
        layer: int,
        slots: torch.Tensor,  # [T] long
        k: torch.Tensor,  # [T, Di]: the indexer's keys
    ) -> None:
        pool = self.index[layer]
        pool.view(-1, pool.shape[-1]).index_copy_(0, slots, k)


def gather(
    pool: torch.Tensor,  # [..., D] stored values (FP8 where `scale` is given)
    scale: torch.Tensor | None,  # pool's shape without D: each row's float32 scale
    dim: int,
    index: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """pool.index_select(dim, index) as `dtype` values: an FP8 pool's rows dequantized (the
    product in float32, rounded once), a plain pool's as they are."""
    if scale is None:
        return pool.index_select(dim, index)
    rows = pool.view(torch.uint8).index_select(dim, index).view(pool.dtype)  # bytes, as _put
    return (rows.float() * scale.index_select(dim, index).unsqueeze(-1)).to(dtype)
