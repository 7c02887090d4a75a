"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts and a free list.

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

    Blocks are reference counted so that a block can be shared (`fork`, e.g. a common prefix);
    it returns to the free list when its last holder frees it. Allocation always hands out the
    lowest free ids first, so a run is reproducible and tests can predict block tables.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._ref_counts = [0] * num_blocks
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
        """Take `n` free blocks (refcount 1 each); raises OutOfBlocksError if there are fewer."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} KV blocks but only {len(self._free)} of {self._num_blocks} are free"
            )
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for b in ids:
            self._ref_counts[b] = 1
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 becomes free."""
        ids = list(block_ids)
        # validate everything first so a bad id leaves the pool untouched rather than half-freed
        pending: dict[int, int] = {}
        for b in ids:
            self._check_id(b)
            pending[b] = pending.get(b, 0) + 1
            if pending[b] > self._ref_counts[b]:
                raise ValueError(
                    f"block {b} freed more times than it is referenced "
                    f"(refcount {self._ref_counts[b]}): double free"
                )
        for b in ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                heapq.heappush(self._free, b)

    def fork(self, block_ids: Iterable[int]) -> list[int]:
        """Share blocks with a new holder: one more reference each; returns the same ids."""
        ids = list(block_ids)
        for b in ids:
            self._check_id(b)
            if self._ref_counts[b] == 0:
                raise ValueError(f"cannot fork block {b}: it is not allocated")
        for b in ids:
            self._ref_counts[b] += 1
        return ids

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool 0..{self._num_blocks - 1}")

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"free={self.num_free_blocks})"
        )
