"""Paged KV-cache bookkeeping: fixed-size blocks and a free list.

Plain Python, no torch: the block manager only hands out integer block ids. The KV pool (a
tensor owned by the runner) is indexed by these ids; this module never sees it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from afd.errors import AfdError


class OutOfBlocksError(AfdError):
    """The pool has fewer free blocks than asked for; the caller should check `can_allocate`."""


class BlockManager:
    """A pool of `num_blocks` KV blocks of `block_size` token slots each.

    Each block has one holder (sharing a common prefix's blocks is the prefix cache's work,
    still to come). Allocation always hands out the lowest free ids first, so a run is
    reproducible and tests can predict block tables.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._used = [False] * num_blocks
        # a min-heap rather than a FIFO so the order does not depend on the free history
        self._free: list[int] = list(range(num_blocks))

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0.0 .. 1.0."""
        return self.num_used_blocks / self._num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` token slots (ceil division)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self._block_size)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; raises OutOfBlocksError if there are fewer."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} KV blocks but only {len(self._free)} of {self._num_blocks} are free"
            )
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for b in ids:
            self._used[b] = True
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the free list."""
        ids = list(block_ids)
        # validate everything first so a bad id leaves the pool untouched rather than half-freed
        seen: set[int] = set()
        for b in ids:
            self._check_id(b)
            if not self._used[b] or b in seen:
                raise ValueError(f"block {b} is not allocated: double free")
            seen.add(b)
        for b in ids:
            self._used[b] = False
            heapq.heappush(self._free, b)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool 0..{self._num_blocks - 1}")

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"free={self.num_free_blocks})"
        )
