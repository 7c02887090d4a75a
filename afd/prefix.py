"""Content addresses of token blocks: the prefix cache's keys and the gateway's routing keys.

A block's hash covers its tokens and its predecessor's hash, so equal hashes mean equal whole
prefixes, not just equal blocks: the K/V of a block depends on every token before it. Whatever
else changes the K/V (a tenant's cache salt today; an adapter or image input later) goes into
the root, so it reaches every block of the chain.

BLAKE2b with a 128-bit digest rather than Python's `hash`: a collision would hand one request
another's K/V, and tuple hashes of small integers are easy to make collide on purpose.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes


def root(extra: bytes = b"") -> BlockHash:
    """The hash before a sequence's first block: everything besides tokens that changes K/V."""
    return hashlib.blake2b(b"afd-prefix-v1" + extra, digest_size=16).digest()


def chain(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The hash of one full block of `tokens` following the block hashed `parent`."""
    return hashlib.blake2b(parent + array.array("q", tokens).tobytes(), digest_size=16).digest()


def extend(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra: bytes = b"",
) -> list[BlockHash]:
    """Grow `hashes` (the hashes of `token_ids`' first blocks, in place) to its first
    `num_blocks` full blocks; returns it. Only blocks whose every token is known are hashed."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    parent = hashes[-1] if hashes else root(extra)
    for i in range(len(hashes), num_blocks):
        parent = chain(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
