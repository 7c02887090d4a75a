"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and the prefix cache.

Plain Python, no torch: the block manager only hands out integer block ids. The KV pool (a
tensor owned by the runner) is indexed by these ids; this module never sees it.

Prefix caching, as vLLM v1 does it: a full block whose K/V is computed can be registered under
its content hash (`afd.prefix`); a later request whose prompt starts with the same blocks takes
them (`touch`) instead of computing them again, so one block may have several holders (a
reference count). A block whose last holder lets go keeps its hash and its K/V and waits among
the free blocks, least recently freed first in line to be reused; only then is its hash
dropped. Blocks that hold nothing worth keeping are handed out before any cached one.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from afd.errors import AfdError
from afd.prefix import BlockHash


class OutOfBlocksError(AfdError):
    """The pool has fewer free blocks than asked for; the caller should check `can_allocate`."""


class BlockManager:
    """A pool of `num_blocks` KV blocks of `block_size` token slots each.

    Allocation hands out never-cached blocks lowest id first (a run is reproducible and tests
    can predict block tables), then cached ones least recently freed first.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._refs = [0] * num_blocks
        # a min-heap rather than a FIFO so the order does not depend on the free history
        self._free: list[int] = list(range(num_blocks))
        # free blocks that still hold a registered prefix, oldest first (eviction order)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0  # cached blocks reused for something else, since creation

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are reused when needed)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a prefix hash, held or not."""
        return len(self._block_of)

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
        return 0 <= n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; raises OutOfBlocksError if there are fewer."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise OutOfBlocksError(
                f"asked for {n} KV blocks but only {self.num_free_blocks} of "
                f"{self._num_blocks} are free"
            )
        ids = []
        for _ in range(n):
            if self._free:
                b = heapq.heappop(self._free)
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self.num_evictions += 1
            self._refs[b] = 1
            ids.append(b)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Let go of blocks (one reference each). A block nobody holds any more is free; a
        cached one stays findable until it is reused, those freed first reused first: free a
        sequence's blocks last-first so that its prefix outlives its tail."""
        ids = list(block_ids)
        # validate everything first so a bad id leaves the pool untouched rather than half-freed
        seen: dict[int, int] = {}
        for b in ids:
            self._check_id(b)
            seen[b] = seen.get(b, 0) + 1
            if seen[b] > self._refs[b]:
                raise ValueError(f"block {b} is not allocated: double free")
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                heapq.heappush(self._free, b)

    # ---- the prefix cache ---------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks holding the longest cached chain of `hashes` (taken: `touch` them)."""
        hit = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each of these cached blocks (a cache hit)."""
        for b in block_ids:
            self._check_id(b)
            if b not in self._hash_of:
                raise ValueError(f"block {b} holds no cached prefix")
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a held, full, computed block findable under its prefix hash. If another block
        already holds that prefix (two requests computed it in the same step), the first one
        stays the cached copy and this block is an ordinary one."""
        self._check_id(block_id)
        if self._refs[block_id] == 0:
            raise ValueError(f"block {block_id} is not allocated: only held blocks are cached")
        if block_hash in self._block_of or block_id in self._hash_of:
            return
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash

    def reset_cache(self) -> int:
        """Forget every cached prefix (the blocks' holders keep them); returns how many."""
        n = len(self._block_of)
        for b in self._evictable:
            heapq.heappush(self._free, b)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()
        return n

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool 0..{self._num_blocks - 1}")

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"free={self.num_free_blocks}, cached={self.num_cached_blocks})"
        )
