"""Logit biases and repetition, frequency and presence penalties: the changes a request asks
for on its logits before a token is chosen (greedy or sampled), in vLLM's order and with
OpenAI's definitions (afd.control.SamplingParams says which). Logprobs are not affected: they
report the model's own distribution."""

from __future__ import annotations

import torch

from afd.control import SamplingParams


def adjust(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],  # B rows' parameters
    prompts: list[list[int]],  # B rows' prompt token ids
    outputs: list[list[int]],  # B rows' generated token ids so far
) -> torch.Tensor:  # [B, V]: `logits` itself when no row asks for a change, else a copy
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    dev = logits.device
    V = logits.shape[1]
    idx = torch.tensor(rows, device=dev)
    x = logits[idx]  # [R, V], a copy
    ps = [params[i] for i in rows]

    bias_rows = [(r, t, b) for r, p in enumerate(ps) for t, b in p.logit_bias if t < V]
    if bias_rows:
        r, t, b = zip(*bias_rows, strict=True)
        x.index_put_(
            (torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
            torch.tensor(b, dtype=x.dtype, device=dev),
            accumulate=True,
        )

    rep = [p.repetition_penalty for p in ps]
    if any(v != 1.0 for v in rep):
        seen = _token_mask(x.shape, [prompts[i] + outputs[i] for i in rows], dev)  # [R, V]
        penalty = torch.tensor(rep, dtype=x.dtype, device=dev).unsqueeze(1)  # [R, 1]
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)

    freq = [p.frequency_penalty for p in ps]
    pres = [p.presence_penalty for p in ps]
    if any(freq) or any(pres):
        counts = _token_counts(x.shape, [outputs[i] for i in rows], dev)  # [R, V]
        x = x - torch.tensor(freq, dtype=x.dtype, device=dev).unsqueeze(1) * counts
        x = x - torch.tensor(pres, dtype=x.dtype, device=dev).unsqueeze(1) * (counts > 0)

    out = logits.clone()
    out[idx] = x
    return out


def _flat(lists: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors of every token of every row."""
    rows = [r for r, ids in enumerate(lists) for _ in ids]
    toks = [t for ids in lists for t in ids]
    return torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(
        toks, dtype=torch.long, device=dev
    )


def _token_counts(shape: torch.Size, lists: list[list[int]], dev: torch.device) -> torch.Tensor:
    """[R, V] float32: how often each token occurs in each row's list."""
    counts = torch.zeros(shape, device=dev)
    r, t = _flat(lists, dev)
    counts.index_put_((r, t), torch.ones(len(t), device=dev), accumulate=True)
    return counts


def _token_mask(shape: torch.Size, lists: list[list[int]], dev: torch.device) -> torch.Tensor:
    """[R, V] bool: whether each token occurs in each row's list."""
    mask = torch.zeros(shape, dtype=torch.bool, device=dev)
    r, t = _flat(lists, dev)
    mask[r, t] = True
    return mask
