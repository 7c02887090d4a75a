"""Speculative decoding by n-gram lookup (vLLM's `ngram` method, also called prompt lookup).

A decoding request's next tokens are guessed from its own text: where its last n tokens occurred
before, the tokens that followed then are the drafts. The scheduler plans the request's last
token and its drafts as one chunk; the runner computes them in one step (on a CPU the step is
bound by reading the weights, which a few more rows share) and keeps drafts as the request's
own choice would have: a greedy request keeps each draft that is its row's argmax, so its
tokens are those it would have had without drafts; a sampling one keeps a draft with the
probability its row gives it (sampler.verify_sampled_drafts), so its tokens are distributed
as they would have been. Then comes the request's own token after the last draft kept. K/V
written for rejected drafts is past `num_computed_tokens`: the next step overwrites it.

A row's grammar mask (structured outputs), logit biases and penalties are applied as if the
drafts before it were output already (a row's token counts only when they all were kept), and
logprobs are reported for each token kept. Requests with what is not followed row by row (bad
words, `allowed_token_ids`, an unmet min_tokens, a grammar that waits for the end of the
reasoning) do not draft: they decode one token a step beside the others.
"""

from __future__ import annotations

from afd.config import SpeculativeConfig
from services.attention.request import Request


def speculable(req: Request) -> bool:
    """Whether `req`'s drafts can be verified row by row (runner._settle: its grammar,
    biases and penalties are; bad words, allowed_token_ids and min_tokens are not)."""
    sp = req.sampling
    return (
        not sp.guide_after  # a guide that waits for the end of the reasoning
        and not sp.bad_words
        and not sp.allowed_token_ids
        and len(req.output_token_ids) >= sp.min_tokens
    )


def room(req: Request, max_model_len: int) -> int:
    """Drafts `req` may take now: accepting all of them and the token after them must leave it
    within max_tokens and the context (so its K/V stays within what admission checked)."""
    left = min(req.sampling.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens)
    return left - 1


# Positions of the text before the index's start indexed per proposal, at most: a long prompt
# is indexed over several steps, newest first, instead of stalling one step for all of it.
BACKLOG_PER_STEP = 1024


class _Index:
    """Where each n-gram of one sequence last ended (n in [lo, hi]): for the n-gram ending at
    position e (tokens e-n .. e-1), e is where its continuation starts. Tokens only grow, so
    the index is extended, never rebuilt: positions from its start on as they come (a later
    one replaces an earlier), and the text before its start a slice at a time going back (an
    earlier one never replaces a later)."""

    def __init__(self, lo: int, hi: int, k: int):
        self.sizes = range(hi, lo - 1, -1)  # longest first
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.upto: int | None = None  # continuations starting before this are indexed ...
        self.back = 0  # ... and from this on
        self.k = k  # drafts to propose next (NgramDrafter.verified)

    def _add(self, ids: list[int], e: int, latest: bool) -> None:
        for n in self.sizes:
            if e >= n:
                key = tuple(ids[e - n : e])
                if latest:
                    self.ends[n][key] = e
                else:
                    self.ends[n].setdefault(key, e)

    def propose(self, ids: list[int], k: int) -> list[int]:
        L = len(ids)
        if self.upto is None:  # the first proposal: the text so far is the backlog
            self.upto = self.back = L - 1
        # every n-gram with at least one token after it; the suffix itself is not yet in
        for e in range(self.upto, L):
            self._add(ids, e, latest=True)
        self.upto = L
        stop = max(0, self.back - BACKLOG_PER_STEP)
        for e in range(self.back - 1, stop - 1, -1):
            self._add(ids, e, latest=False)
        self.back = stop
        for n in self.sizes:
            if L <= n:
                continue
            e = self.ends[n].get(tuple(ids[L - n :]))
            if e is None:
                continue
            # the text from e on is taken to repeat; past the end it repeats the drafts
            # themselves, so a loop shorter than k still gives k drafts
            out: list[int] = []
            for i in range(k):
                out.append(ids[e + i] if e + i < L else out[e + i - L])
            return out
        return []


class NgramDrafter:
    """Drafts per request, each from an index of its own tokens kept while it runs."""

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self._index: dict[str, _Index] = {}

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(k, limit) drafts for `req`, k as `verified` last set it (at first
        num_speculative_tokens); none when it may not draft or no n-gram of its end occurred
        before."""
        if limit <= 0 or not speculable(req):
            return []
        index = self._index.get(req.request_id)
        if index is None:
            c = self.cfg
            index = _Index(c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens)
            self._index[req.request_id] = index
        return index.propose(req.all_token_ids, min(index.k, limit))

    def verified(self, request_id: str, drafted: int, kept: int) -> None:
        """After a step verified `drafted` drafts of the request and kept `kept`: next time
        it proposes one more than it kept, or one more than now if it kept them all (up to
        num_speculative_tokens). A rejected draft makes its step's chunk longer for nothing,
        so where guesses fail the request guesses less; where they hold it guesses more."""
        index = self._index.get(request_id)
        if index is not None:
            grown = index.k + 1 if kept == drafted else kept + 1
            index.k = min(self.cfg.num_speculative_tokens, grown)

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
