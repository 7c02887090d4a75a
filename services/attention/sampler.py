"""Sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs; biases and
penalties first (penalties.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from afd.control import Logprob, SamplingParams
from afd.kernels import argmax
from services.attention import penalties


def sample(
    logits: torch.Tensor,  # [B, V] float32, the model's: changed in place by penalties
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompts: Sequence[torch.Tensor | Sequence[int]] | None = None,  # for penalties: B rows'
    outputs: Sequence[Sequence[int]] | None = None,  # prompt ids and generated ids so far
    banned: Sequence[Sequence[int]] = (),  # per row, tokens it may not choose (min_tokens)
    masked: bool = False,  # a grammar masked some rows already
    argmax: torch.Tensor | None = None,  # [B] int64: each row's argmax of logits as given
) -> tuple[list[int], list[Logprob | None], list[int]]:
    """One token per row, chosen after the row's biases, penalties and exclusions; with
    logprobs asked, the sampled token's and the top-n alternatives' log-probabilities under
    the model's own (unscaled, unpenalized, unrestricted) distribution, as vLLM reports them.
    The third list: the rows that had no token left to choose (`exclude_`); their tokens
    mean nothing. `argmax`, where the caller has it, is the answer when every row is greedy
    and nothing changes the logits or asks for logprobs (the step's rows read no further)."""
    B = logits.shape[0]
    if argmax is not None and not masked and _plain_greedy(params, banned):
        return argmax.tolist(), [None] * B, []
    dev = logits.device  # index tensors live beside the logits (a CUDA device's, say)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    # of the model's logits, before any penalty; a token a grammar masked out reads as vLLM
    # reports it, -9999, not -inf (which JSON cannot carry)
    logp = None
    if want:
        logp = torch.log_softmax(logits[torch.tensor(want, device=dev)], dim=-1).clamp_(-9999.0)
    if any(p.adjusts_logits for p in params):
        if prompts is None or outputs is None:
            raise ValueError("penalties need every row's prompt and output token ids")
        penalties.adjust_(logits, params, prompts, outputs)
    empty = exclude_(logits, params, banned, masked)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == B and not want:  # the common decode case
        return argmax_rows(logits).tolist(), [None] * B, empty
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    if greedy:
        idx = torch.tensor(greedy, device=dev)
        tokens[idx] = argmax_rows(logits[idx])
    rest = [i for i, p in enumerate(params) if not p.greedy]
    if rest:
        # every sampled row filtered at once; one multinomial for the rows without a seed,
        # one per seeded row (its own generator keeps its draws reproducible)
        x = _filtered(logits[torch.tensor(rest, device=dev)], [params[i] for i in rest])  # [R, V]
        probs = torch.softmax(x, dim=-1)
        free = [j for j, i in enumerate(rest) if generators[i] is None]
        if free:
            drawn = torch.multinomial(probs[torch.tensor(free, device=dev)], 1).squeeze(1)
            tokens[torch.tensor([rest[j] for j in free], device=dev)] = drawn
        for j, i in enumerate(rest):
            if generators[i] is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    out_tokens = tokens.tolist()
    lps: list[Logprob | None] = [None] * B
    if logp is not None:
        # one gather and one topk for every row that asked, then plain lists
        rows = torch.tensor(want, device=dev)
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
    return out_tokens, lps, empty


def exclude_(
    logits: torch.Tensor,  # [B, V] float32, the model's (a grammar's mask applied): in place
    params: list[SamplingParams],
    banned: Sequence[Sequence[int]],  # per row, tokens it may not choose now (min_tokens, ...)
    masked: bool = False,  # a grammar masked some rows already
) -> list[int]:
    """Set to -inf every token a row may not choose (its bans, and all but its
    allowed_token_ids); returns the rows left with no token at all (a grammar and
    allowed_token_ids that share none, say), whose logits become harmless zeros: those
    requests cannot go on, and one of them must not fail the step of the others."""
    penalties.ban_(logits, banned)
    allowed = any(p.allowed_token_ids for p in params)
    if allowed:
        penalties.allow_only_(logits, [p.allowed_token_ids for p in params])
    if not (masked or allowed or any(banned)):
        return []
    empty = torch.isneginf(logits).all(dim=-1).nonzero().flatten().tolist()
    for i in empty:
        logits[i].zero_()
    return empty


def _plain_greedy(params: list[SamplingParams], banned: Sequence[Sequence[int]]) -> bool:
    """Every row greedy, without logprobs, and nothing that changes its logits first."""
    for p in params:
        if not p.greedy or p.logprobs is not None or p.adjusts_logits or p.allowed_token_ids:
            return False
    return not any(banned)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    """torch.argmax over the last dimension; the native one (argmax.c) where it runs."""
    return argmax.rows(logits) if argmax.usable(logits) else logits.argmax(dim=-1)


def _filtered(
    logits: torch.Tensor,  # [R, V] float32
    params: list[SamplingParams],  # R rows' parameters, none greedy
) -> torch.Tensor:  # [R, V]: logits / temperature, -inf outside each row's min-p, top-k, top-p
    R, V = logits.shape
    dev = logits.device
    x = logits / torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        # a token stays while its probability is at least min_p times the likeliest one's:
        # in logits, while it is within log(min_p) of the row's largest (min_p 0: -inf, all)
        floor = torch.tensor([p.min_p for p in params], device=dev).log().unsqueeze(1)  # [R, 1]
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floor, float("-inf"))
    ks = [p.top_k if p.top_k and 0 < p.top_k < V else 0 for p in params]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values  # [R, max k], best first
        k = torch.tensor(ks, device=dev)
        cut = kth.gather(1, (k - 1).clamp(min=0).unsqueeze(1))  # [R, 1]
        cut[k == 0] = float("-inf")  # rows without top-k keep everything
        x = x.masked_fill(x < cut, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        ps = torch.tensor([p.top_p for p in params], device=dev)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token once the mass before it already reaches top_p (the first always stays);
        # rows with top_p = 1 drop nothing, whatever the rounding of their sums
        drop = (probs.cumsum(-1) - probs) >= ps.unsqueeze(1)
        drop &= (ps < 1.0).unsqueeze(1)
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def score(
    logits: torch.Tensor,  # [P, V] float32
    targets: torch.Tensor,  # [P] long: the token that followed each row
    top: int,  # alternatives per row
) -> list[Logprob]:
    """Each target's log-probability under its row's distribution, with the row's top `top`
    alternatives (prompt logprobs: how likely the model found each prompt token)."""
    return logprobs_of(logits, targets.tolist(), top)


def logprobs_of(
    logits: torch.Tensor,  # [m, V] float32, the model's own (before biases and penalties)
    tokens: list[int],  # m: the token chosen at each row
    top: int,  # alternatives per row
) -> list[Logprob]:
    """Each chosen token's log-probability under its row, with the row's `top` best, as
    `sample` reports them (-9999 for -inf, which JSON cannot carry: a token a grammar
    masked out)."""
    logp = torch.log_softmax(logits, dim=-1).clamp_(-9999.0)
    at = torch.tensor(tokens, device=logits.device).unsqueeze(1)
    chosen = logp.gather(1, at).squeeze(1).tolist()
    if not top:
        return [Logprob(t, v, []) for t, v in zip(tokens, chosen, strict=True)]
    best = torch.topk(logp, top, dim=-1)
    alts = zip(best.indices.tolist(), best.values.tolist(), strict=True)
    return [
        Logprob(t, v, list(zip(i, a, strict=True)))
        for t, v, (i, a) in zip(tokens, chosen, alts, strict=True)
    ]


def verify_drafts(
    logits: torch.Tensor,  # [1 + k, V] float32: the rows of a request's last token and drafts
    drafts: tuple[int, ...],  # k
) -> tuple[list[int], int]:
    """(the drafts kept, the model's token after them): drafts are kept while each is the
    argmax of the row before it."""
    chosen = argmax_rows(logits).tolist()
    kept = 0
    while kept < len(drafts) and chosen[kept] == drafts[kept]:
        kept += 1
    return list(drafts[:kept]), chosen[kept]


def verify_sampled_drafts(
    logits: torch.Tensor,  # [1 + k, V] float32: the rows of a request's last token and drafts
    drafts: tuple[int, ...],  # k
    params: SamplingParams,  # the request's (not greedy)
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Speculative sampling for drafts that are certain guesses (an n-gram's): each draft is
    kept with the probability the request's own distribution (temperature, min-p, top-k,
    top-p) gives it at its row; the first one rejected gives way to a draw from that row
    without it, or when all are kept the last row is drawn from. Each token comes out
    distributed exactly as one drawn a step at a time."""
    dev = logits.device
    probs = torch.softmax(_filtered(logits, [params] * logits.shape[0]), dim=-1)  # [1 + k, V]
    kept = torch.tensor(drafts, device=dev).unsqueeze(1)
    chance = probs[:-1].gather(1, kept).squeeze(1).tolist()  # [k]
    draws = torch.rand(len(drafts), generator=generator, device=dev).tolist()
    for i, (p, u) in enumerate(zip(chance, draws, strict=True)):
        if u >= p:  # rejected: the rest of the row's mass, p < 1, is what is drawn from
            row = probs[i].clone()
            row[drafts[i]] = 0.0
            return list(drafts[:i]), int(torch.multinomial(row, 1, generator=generator)[0])
    return list(drafts), int(torch.multinomial(probs[-1], 1, generator=generator)[0])
