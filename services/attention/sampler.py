"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from afd.control import Logprob, SamplingParams


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[Logprob | None]]:
    """One token per row; with logprobs asked, the sampled token's and the top-n alternatives'
    log-probabilities under the model's own (unscaled) distribution, as vLLM reports them."""
    B = logits.shape[0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == B and all(p.logprobs is None for p in params):  # the common decode case
        return logits.argmax(dim=-1).tolist(), [None] * B
    tokens = torch.empty(B, dtype=torch.long)
    if greedy:
        idx = torch.tensor(greedy)
        tokens[idx] = logits[idx].argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    out_tokens = tokens.tolist()
    lps: list[Logprob | None] = [None] * B
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        # one log_softmax, one gather and one topk for every row that asked, then plain lists
        rows = torch.tensor(want)
        logp = torch.log_softmax(logits[rows], dim=-1)  # [W, V]
        chosen = logp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()  # [W]
        n_max = max(params[i].logprobs or 0 for i in want)
        top_ids, top_lps = ([], [])
        if n_max:
            top = torch.topk(logp, n_max, dim=-1)  # [W, n_max], best first
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        for row, i in enumerate(want):
            n = params[i].logprobs or 0
            alts = list(zip(top_ids[row][:n], top_lps[row][:n], strict=True)) if n else []
            lps[i] = Logprob(out_tokens[i], chosen[row], alts)
    return out_tokens, lps


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    x = logits / p.temperature  # [V]
    if p.top_k and p.top_k > 0 and p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.index_put((order[drop],), torch.tensor(float("-inf")))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
