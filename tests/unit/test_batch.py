"""Micro-batch tensors from a scheduler plan (services/attention/batch.py)."""

import pytest
import torch

from services.attention import batch
from services.attention.request import Request
from services.attention.scheduler import ScheduledSeq

BS = 4


def _seq(rid: str, start: int, n: int, blocks: list[int], sample: bool = True) -> ScheduledSeq:
    req = Request(rid, list(range(start + n)))
    return ScheduledSeq(req, list(range(start, start + n)), start, blocks, sample)


def test_rows_positions_and_slots_follow_each_sequence_block_table():
    seqs = [
        _seq("p", 0, 6, [9, 3]),  # a prefill (rows go after the decodes)
        _seq("a", 5, 1, [7, 2, 11]),  # decode at position 5: block 2, offset 1
        _seq("b", 0, 1, [4]),  # a one-token prompt is a decode too
        _seq("c", 11, 1, [1, 5, 8, 6]),  # more blocks than it needs yet
    ]
    mb = batch.build(seqs, BS)
    order = [s.request.request_id for s in mb.seqs]
    assert order == ["a", "b", "c", "p"]
    assert mb.meta.num_decode == 3
    expect_pos, expect_slots = [], []
    for s in mb.seqs:
        for p in range(s.start_pos, s.start_pos + s.num_new_tokens):
            expect_pos.append(p)
            expect_slots.append(s.block_ids[p // BS] * BS + p % BS)
    assert mb.meta.positions.tolist() == expect_pos
    assert mb.meta.slots.tolist() == expect_slots
    assert mb.meta.decode_lens.tolist() == [6, 1, 12]
    # the table: each decode's blocks up to the longest, padded with block 0
    assert mb.meta.decode_blocks.tolist() == [[7, 2, 11], [4, 0, 0], [1, 5, 8]]
    assert mb.token_ids.tolist() == [5, 0, 11, 0, 1, 2, 3, 4, 5]
    assert mb.sample_rows.tolist() == [0, 1, 2, 8]
    bias = mb.meta.decode_bias  # [D, 1, nblk * bs]: -inf past each row's length
    assert torch.isinf(bias[1, 0, 1:]).all() and not torch.isinf(bias[1, 0, :1]).any()


def test_a_decode_without_a_block_for_its_position_is_refused():
    with pytest.raises(RuntimeError, match="no KV block"):
        batch.build([_seq("a", 8, 1, [7, 2])], BS)
