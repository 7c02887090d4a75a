"""The paged KV pool: per layer, K and V slots addressed as block_id * block_size + offset."""

from __future__ import annotations

import torch

from afd.config import CacheConfig, ModelConfig


def num_blocks_for(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_blocks:
        return cache.num_blocks
    per_block = 2 * cfg.num_layers * cache.block_size * cfg.kv_size * dtype.itemsize
    return max(1, int(cache.kv_cache_memory_gb * (1 << 30)) // per_block)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Heads outermost, then whole blocks: gathering a sequence's blocks copies 2-4 KiB rows
        # and yields [kvh, L, D] directly, the layout the attention matmuls read.
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)  # [kvh, NB, bs, D]
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # [T] long
        k: torch.Tensor,  # [T, kvh, D]
        v: torch.Tensor,  # [T, kvh, D]
    ) -> None:
        kvh, _, _, D = self.k[layer].shape
        self.k[layer].view(kvh, -1, D).index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].view(kvh, -1, D).index_copy_(1, slots, v.transpose(0, 1))
