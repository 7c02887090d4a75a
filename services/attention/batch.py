"""Turns a scheduler plan into micro-batches of tensors (the only place tensors are built)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.attention.paged_attention import AttnMeta, PrefillSeq
from services.attention.scheduler import ScheduledSeq


@dataclass(frozen=True)
class MicroBatch:
    seqs: tuple[ScheduledSeq, ...]  # decodes (speculating ones too) first, then prefills
    token_ids: torch.Tensor  # [T] long
    meta: AttnMeta
    # [B + drafts] long: the row of each sampling sequence's last token (and its drafts')
    sample_rows: torch.Tensor
    sample_seqs: tuple[ScheduledSeq, ...]
    # prompt logprobs: rows whose next prompt token is scored, those tokens, and per request
    # (in row order) how many rows are its
    prompt_rows: torch.Tensor | None = None  # [P] long
    prompt_targets: torch.Tensor | None = None  # [P] long
    prompt_owners: tuple[tuple[str, int], ...] = ()
    # sample_rows is every row in order (a decode step): the head takes the hidden as it is
    samples_all: bool = False
    # decode steps the native stack may run in one call (burst.py), each row's
    # blocks covering positions + burst - 1
    burst: int = 1


def split(seqs: list[ScheduledSeq], n: int) -> list[list[ScheduledSeq]]:
    """Contiguous groups of near-equal token counts; fewer groups if there are fewer sequences."""
    n = max(1, min(n, len(seqs)))
    total = sum(s.num_new_tokens for s in seqs)
    groups: list[list[ScheduledSeq]] = [[]]
    acc = 0
    for i, s in enumerate(seqs):
        left_seqs, left_groups = len(seqs) - i, n - len(groups)
        full = acc >= total * len(groups) / n
        if groups[-1] and left_groups > 0 and (full or left_seqs <= left_groups):
            groups.append([])
        groups[-1].append(s)
        acc += s.num_new_tokens
    return groups


def build(seqs: list[ScheduledSeq], block_size: int) -> MicroBatch:
    # A speculating seq (its last token and its drafts) is decode rows too, one per token,
    # each attending up to its own position: every row's K/V is written before any row
    # attends, so that is causal attention over the chunk, on the decode path's kernels.
    decodes = [s for s in seqs if s.num_new_tokens == 1 or s.draft_ids]
    prefills = [s for s in seqs if s.num_new_tokens > 1 and not s.draft_ids]
    ordered = decodes + prefills
    tokens = [t for s in ordered for t in s.token_ids]
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    table = lens = None
    num_decode, burst = 0, 1
    if decodes:
        # all decode rows at once, as plain ints: tensors built per sequence cost a few torch
        # calls each, which add up with batch and context on every step's critical path
        rows = [(s, s.start_pos + i) for s in decodes for i in range(s.num_new_tokens)]
        num_decode = len(rows)
        burst = min(s.burst for s in seqs)
        table, lens = _decode_blocks(rows, block_size, burst)
        positions.append(torch.tensor([p for _, p in rows]))
        slots.append(
            torch.tensor(
                [s.block_ids[p // block_size] * block_size + p % block_size for s, p in rows]
            )
        )
    for s in prefills:
        pos = torch.arange(s.start_pos, s.start_pos + s.num_new_tokens)
        positions.append(pos)
        slots.append(_slots(torch.tensor(s.block_ids), pos, block_size))
    meta = AttnMeta(
        positions=torch.cat(positions) if len(positions) > 1 else positions[0],
        slots=torch.cat(slots) if len(slots) > 1 else slots[0],
        num_decode=num_decode,
        decode_blocks=table,
        prefills=_prefill_seqs(prefills, num_decode, block_size) if prefills else (),
        decode_lens=lens,
        block_size=block_size,
    )
    rows, sample_seqs, row = [], [], 0
    p_rows: list[int] = []
    p_targets: list[int] = []
    owners: list[tuple[str, int]] = []
    for s in ordered:
        req = s.request
        # positions of this chunk whose next prompt token is still to be scored
        score = range(
            max(s.start_pos, req.prompt_positions_to_score.start),
            min(s.start_pos + s.num_new_tokens, req.prompt_positions_to_score.stop),
        )
        if len(score):
            p_rows += [row + p - s.start_pos for p in score]
            p_targets += req.prompt_token_ids[score.start + 1 : score.stop + 1]
            owners.append((req.request_id, len(score)))
        row += s.num_new_tokens
        if s.sample:  # a speculating seq's last token and each draft: 1 + k rows
            rows += range(row - 1 - len(s.draft_ids), row)
            sample_seqs.append(s)
    return MicroBatch(
        seqs=tuple(ordered),
        token_ids=torch.tensor(tokens, dtype=torch.long),
        meta=meta,
        sample_rows=torch.tensor(rows, dtype=torch.long),
        sample_seqs=tuple(sample_seqs),
        prompt_rows=torch.tensor(p_rows, dtype=torch.long) if p_rows else None,
        prompt_targets=torch.tensor(p_targets, dtype=torch.long) if p_rows else None,
        prompt_owners=tuple(owners),
        samples_all=len(rows) == row,  # increasing and distinct, so 0 .. row - 1
        burst=burst,
    )


def to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """The micro-batch's tensors on `device` (built on the host, moved once per step)."""
    if device.type == "cpu":
        return mb

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    m = mb.meta
    meta = replace(
        m,
        positions=move(m.positions),
        slots=move(m.slots),
        decode_blocks=move(m.decode_blocks),
        decode_lens=move(m.decode_lens),
        prefills=tuple(replace(p, blocks=move(p.blocks)) for p in m.prefills),  # masks built there
    )
    return replace(
        mb,
        token_ids=move(mb.token_ids),
        meta=meta,
        sample_rows=move(mb.sample_rows),
        prompt_rows=move(mb.prompt_rows),
        prompt_targets=move(mb.prompt_targets),
    )


def _slots(blocks: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    return blocks[pos // block_size] * block_size + pos % block_size


def _decode_blocks(
    rows: list[tuple[ScheduledSeq, int]],  # each decode row's seq and position
    bs: int,
    burst: int = 1,  # positions each row's blocks cover: p .. p + burst - 1
) -> tuple[torch.Tensor, torch.Tensor]:
    n = [p + 1 for _, p in rows]  # keys each row attends to
    short = [s.request.request_id for s, p in rows if len(s.block_ids) * bs < p + burst]
    if short:  # the table's padding would otherwise hand the row someone else's block 0
        raise RuntimeError(f"requests {short} have no KV block for their position")
    lens = torch.tensor(n)
    nblk = (max(n) + burst - 1 + bs - 1) // bs
    # one tensor from one list, padded with block 0 (masked)
    table = [s.block_ids[:nblk] + [0] * (nblk - min(nblk, len(s.block_ids))) for s, _ in rows]
    return torch.tensor(table, dtype=torch.long), lens


def _prefill_seqs(prefills: list[ScheduledSeq], first_row: int, bs: int) -> tuple[PrefillSeq, ...]:
    out = []
    row = first_row
    for s in prefills:
        n, L = s.num_new_tokens, s.start_pos + s.num_new_tokens
        nblk = (L + bs - 1) // bs
        blocks = torch.tensor(s.block_ids[:nblk], dtype=torch.long)
        out.append(
            PrefillSeq(q_start=row, q_len=n, blocks=blocks, start=s.start_pos, block_size=bs)
        )
        row += n
    return tuple(out)
