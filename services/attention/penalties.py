"""Logit biases and repetition, frequency and presence penalties: the changes a request asks
for on its logits before a token is chosen (greedy or sampled), in vLLM's order and with
OpenAI's definitions (afd.control.SamplingParams says which).

Only the logits of tokens a row has seen (or biases) change, so the work is gathered and
scattered at those positions of the flattened [B, V] logits, every row at once: its cost
follows the tokens seen, not the batch times a vocabulary of 10^5 or more."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from afd.control import SamplingParams


def adjust_(
    logits: torch.Tensor,  # [B, V] float32, contiguous: changed in place
    params: list[SamplingParams],  # B rows' parameters
    prompts: Sequence[torch.Tensor | Sequence[int]],  # B rows' prompt token ids (repeats allowed)
    outputs: Sequence[Sequence[int]],  # B rows' generated token ids so far
) -> None:
    B, V = logits.shape
    flat = logits.view(-1)  # [B V]
    dev = logits.device

    def positions(rows: list[int], ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat positions of each row's ids, and each position's row."""
        lens = torch.tensor([len(t) for t in ids], device=dev)
        row = torch.repeat_interleave(torch.tensor(rows, device=dev), lens)
        return row * V + torch.cat(ids).to(dev), row

    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        rows, toks, values = zip(*bias, strict=True)
        at = torch.tensor(rows, device=dev) * V + torch.tensor(toks, device=dev)
        flat.index_add_(0, at, torch.tensor(values, dtype=logits.dtype, device=dev))

    out = {i: torch.tensor(outputs[i], dtype=torch.long) for i, p in enumerate(params) if _uses(p)}

    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        # prompt and output ids together; a token met twice gets the same new value twice
        seen = [torch.cat([torch.as_tensor(prompts[i], dtype=torch.long), out[i]]) for i in rep]
        at, row = positions(rep, seen)
        penalty = torch.tensor([params[i].repetition_penalty for i in range(B)], device=dev)[row]
        x = flat[at]
        flat[at] = torch.where(x > 0, x / penalty, x * penalty)

    counted = [
        i
        for i in out
        if len(out[i]) and (params[i].frequency_penalty or params[i].presence_penalty)
    ]
    if counted:
        at, _ = positions(counted, [out[i] for i in counted])
        at, count = torch.unique(at, return_counts=True)  # each token generated, how often
        row = at // V
        freq = torch.tensor([q.frequency_penalty for q in params], device=dev)[row]
        pres = torch.tensor([q.presence_penalty for q in params], device=dev)[row]
        flat[at] = flat[at] - freq * count - pres  # OpenAI's formula, term by term


def _uses(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty or p.presence_penalty)


def ban_(
    logits: torch.Tensor,  # [B, V] float32, contiguous: changed in place
    banned: Sequence[Sequence[int]],  # per row, the tokens it may not choose now
) -> None:
    """min_tokens: the rows still short of it cannot choose EOS or a stop token."""
    pairs = [(i, t) for i, ids in enumerate(banned) for t in ids]
    if pairs:
        rows, toks = zip(*pairs, strict=True)
        dev = logits.device
        at = torch.tensor(rows, device=dev) * logits.shape[1] + torch.tensor(toks, device=dev)
        logits.view(-1)[at] = float("-inf")


def allow_only_(
    logits: torch.Tensor,  # [B, V] float32: changed in place
    allowed: Sequence[Sequence[int]],  # per row, the only tokens it may choose (none: any)
) -> None:
    """vLLM's allowed_token_ids: every other token of the rows that give them is out."""
    for i, ids in enumerate(allowed):
        if ids:
            at = torch.tensor(ids, device=logits.device)
            keep = logits[i].index_select(0, at)
            logits[i].fill_(float("-inf"))
            logits[i].index_copy_(0, at, keep)
