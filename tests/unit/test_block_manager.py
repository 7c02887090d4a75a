"""BlockManager: allocation order, exhaustion and error cases."""

from __future__ import annotations

import pytest

from services.attention.block_manager import BlockManager, OutOfBlocksError


def test_fresh_pool_is_all_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_blocks, bm.block_size) == (8, 4)
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    assert bm.usage == 0.0


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_is_ceil(tokens: int, blocks: int) -> None:
    assert BlockManager(16, 4).blocks_needed(tokens) == blocks


def test_allocate_lowest_ids_first_and_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate(3)
    b = bm.allocate(2)
    assert a == [0, 1, 2]
    assert b == [3, 4]
    assert bm.num_free_blocks == 3
    assert bm.num_used_blocks == 5
    assert bm.usage == pytest.approx(5 / 8)


def test_free_returns_blocks_and_they_are_reused_deterministically() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = bm.allocate(3)  # 0 1 2
    bm.allocate(2)  # 3 4
    bm.free([a[2], a[0]])
    assert bm.num_free_blocks == 3
    # lowest free id first, whatever order they were freed in
    assert bm.allocate(3) == [0, 2, 5]
    assert bm.num_free_blocks == 0


def test_exhausting_the_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.can_allocate(4)
    assert not bm.can_allocate(5)
    bm.allocate(4)
    assert bm.usage == 1.0
    assert not bm.can_allocate(1)
    assert bm.can_allocate(0)
    with pytest.raises(OutOfBlocksError, match="asked for 1 KV blocks but only 0 of 4"):
        bm.allocate(1)
    assert bm.allocate(0) == []


def test_failed_allocate_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate(2)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(3)
    assert bm.num_free_blocks == 2
    assert bm.allocate(2) == [2, 3]


def test_double_free_raises_and_leaves_pool_untouched() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = bm.allocate(2)
    bm.free(a)
    with pytest.raises(ValueError, match="double free"):
        bm.free([a[0]])
    b = bm.allocate(1)
    # the same id twice in one call is one free too many; nothing changes
    with pytest.raises(ValueError, match="double free"):
        bm.free([b[0], b[0]])
    assert bm.num_free_blocks == 3


def test_bad_ids_raise() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="not allocated"):
        bm.free([0])
    with pytest.raises(ValueError, match="outside the pool"):
        bm.free([4])
    with pytest.raises(ValueError, match="outside the pool"):
        bm.free([-1])
    with pytest.raises(ValueError):
        bm.allocate(-1)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0)])
def test_invalid_sizes_raise(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
