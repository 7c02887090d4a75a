"""The model runner: executes one scheduler plan and samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afd.control import Logprob
from services.attention import batch, penalties
from services.attention.dispatch import FFNDispatcher
from services.attention.guides import Guides
from services.attention.kv_cache import KVCache
from services.attention.model import AttentionModel
from services.attention.pipeline import run_layers
from services.attention.request import Request
from services.attention.sampler import (
    logprobs_of,
    sample,
    score,
    verify_drafts,
    verify_sampled_drafts,
)
from services.attention.scheduler import ScheduledSeq, SchedulerOutput
from services.attention.stack import DecodeStack

# Prompt rows scored per LM-head call: [rows, V] float32 logits at a time, not the whole prompt.
SCORE_ROWS = 256


@dataclass
class Executed:
    """What a step's execution gives the scheduler, per request id: the sampled token (for a
    speculating request, the token after its kept drafts), its logprob when asked, the prompt
    logprobs this step scored and the drafts kept; the requests whose grammar (structured
    outputs) has ended, and those left with no token they may choose (no sampled token: they
    cannot go on)."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    kept: dict[str, list[tuple[int, Logprob | None]]] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    stuck: set[str] = field(default_factory=set)
    steps: int = 1  # decode steps run (a burst's, burst.py: its tokens are in `kept`)


class ModelRunner:
    def __init__(
        self,
        model: AttentionModel,
        cache: KVCache,
        dispatcher: FFNDispatcher,
        micro_batches: int,
        decode_stack: bool = True,
        guides: Guides | None = None,
    ):
        self.model = model
        self.cache = cache
        self.dispatcher = dispatcher
        self.micro_batches = micro_batches
        self._generators: dict[str, torch.Generator] = {}
        self._prompts: dict[str, torch.Tensor] = {}  # request id -> its prompt's distinct ids
        self.guides = guides or Guides(model.cfg)  # structured outputs
        # a decode step's layers as one native call where they may be (stack.py)
        self.stack = DecodeStack(model, cache, dispatcher) if decode_stack else None

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> Executed:
        """Run the plan's micro-batches through the layers and choose each sampling request's
        tokens (Executed says what came back)."""
        groups = batch.split(plan.scheduled, self.micro_batches)
        dev = self.model.device
        mbs = [batch.to_device(batch.build(g, self.cache.block_size), dev) for g in groups]
        out = Executed()

        def head(m: int, h: torch.Tensor) -> torch.Tensor:  # [T_m, H] -> [B_m, V] float32
            if mbs[m].prompt_rows is not None:
                self._score_prompts(mbs[m], h, out.prompt_logprobs)
            rows = mbs[m].sample_rows
            if not len(rows):
                return h.new_empty(0)
            # the native stack's call ran the head already (stack.py), or a decode step samples
            # every row in order: h as it is, no copy
            fused = self.stack.take_logits(h) if self.stack is not None else None
            if fused is not None:
                return fused
            return self.model.logits(h if mbs[m].samples_all else h.index_select(0, rows))

        per_mb = run_layers(self.model, self.cache, self.dispatcher, mbs, head, self.stack)
        seqs = [s for mb in mbs for s in mb.sample_seqs]
        if not seqs:
            return out
        burst = self.stack.take_burst() if self.stack is not None else None
        if burst is not None:  # every row's token at each step, in order
            return _burst_out(*burst, seqs, out)
        parts = [x for x in per_mb if x.numel()]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # [B + drafts, V] float32
        if any(s.draft_ids for s in seqs):
            logits, seqs = self._verify(logits, seqs, out)
            if not seqs:
                return out
        params = [s.request.sampling for s in seqs]
        gens = [self._generator(s.request.request_id, s.request.sampling.seed) for s in seqs]
        reqs = [s.request for s in seqs]  # their tokens so far: for penalties
        ids = [r.request_id for r in reqs]
        if self.guides.active:
            self.guides.mask_(logits, ids)
        prompts = [
            self._prompt_ids(r) if r.sampling.repetition_penalty != 1.0 else () for r in reqs
        ]
        outputs = [r.output_token_ids for r in reqs]
        banned = [_banned(r) for r in reqs]
        # greedy picks the stack's head made as it wrote these logits, where it ran
        picked = self.stack.argmax_of(logits) if self.stack is not None else None
        tokens, lps, empty = sample(
            logits, params, gens, prompts, outputs, banned, self.guides.active, picked
        )
        out.stuck = {ids[i] for i in empty}
        sampled = {r: t for r, t in zip(ids, tokens, strict=True) if r not in out.stuck}
        out.ended |= {
            r for r, t in sampled.items() if self.guides.active and self.guides.accept(r, t)
        }
        out.sampled |= sampled
        out.logprobs |= {
            s.request.request_id: lp for s, lp in zip(seqs, lps, strict=True) if lp is not None
        }
        return out

    def _verify(
        self, logits: torch.Tensor, seqs: list[ScheduledSeq], out: Executed
    ) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Settle the speculating seqs (their drafts kept, the token after them sampled);
        returns the others' rows [B', V] and the others."""
        rest, rows, row = [], [], 0
        for s in seqs:
            n = 1 + len(s.draft_ids)
            if s.draft_ids:
                self._settle(s, logits[row : row + n], out)
            else:
                rest.append(s)
                rows.append(row)
            row += n
        if not rest:
            return logits[:0], rest
        return logits.index_select(0, torch.tensor(rows, device=logits.device)), rest

    def _settle(self, s: ScheduledSeq, rows: torch.Tensor, out: Executed) -> None:
        """One speculating seq: rows [1 + k, V] are its last token's and its drafts'. Row i
        is masked by its grammar and penalized as if the first i drafts were output already
        (they are, where it counts: a row's token matters only when every draft before it was
        kept); the grammar then takes the tokens kept, and ends the request at one that
        completes it."""
        req, sp = s.request, s.request.sampling
        rid, drafts = req.request_id, s.draft_ids
        if sp.guide_kind:  # in place: these rows are this seq's alone
            self.guides.mask_drafted_(rows, rid, drafts)
        raw = rows
        if sp.adjusts_logits:
            rows = rows.clone()
            n = rows.shape[0]
            prompt = self._prompt_ids(req) if sp.repetition_penalty != 1.0 else ()
            seen = [req.output_token_ids + list(drafts[:i]) for i in range(n)]
            penalties.adjust_(rows, [sp] * n, [prompt] * n, seen)
        if sp.greedy:
            kept, token = verify_drafts(rows, drafts)
        else:
            kept, token = verify_sampled_drafts(rows, drafts, sp, self._generator(rid, sp.seed))
        if sp.guide_kind:
            for i, t in enumerate([*kept, token]):
                if self.guides.accept(rid, t):  # the grammar is complete: the output ends here
                    kept, token = kept[:i], t
                    out.ended.add(rid)
                    break
        out.sampled[rid] = token
        lps: list[Logprob | None] = [None] * (len(kept) + 1)
        if sp.logprobs is not None:  # of the model's own distribution, as `sample` gives them
            lps = [*logprobs_of(raw[: len(kept) + 1], [*kept, token], sp.logprobs)]
            out.logprobs[rid] = lps[-1]
        out.kept[rid] = list(zip(kept, lps[:-1], strict=True))

    def _score_prompts(
        self, mb: batch.MicroBatch, h: torch.Tensor, out: dict[str, list[Logprob]]
    ) -> None:
        """The log-probability of each prompt token this micro-batch's rows predict, a few
        hundred rows of logits at a time."""
        assert mb.prompt_rows is not None and mb.prompt_targets is not None
        tops = {s.request.request_id: s.request.sampling.prompt_logprobs or 0 for s in mb.seqs}
        start = 0
        for rid, n in mb.prompt_owners:
            got: list[Logprob] = []
            for a in range(start, start + n, SCORE_ROWS):
                b = min(start + n, a + SCORE_ROWS)
                logits = self.model.logits(h.index_select(0, mb.prompt_rows[a:b]))
                got += score(logits, mb.prompt_targets[a:b], tops[rid])
            out[rid] = got
            start += n

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            # on the logits' device: a seeded draw never leaves it
            gen = torch.Generator(self.model.device).manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def _prompt_ids(self, req: Request) -> torch.Tensor:
        """The prompt's distinct token ids (a repetition penalty's), made once per request."""
        ids = self._prompts.get(req.request_id)
        if ids is None:
            ids = self._prompts[req.request_id] = torch.tensor(req.prompt_token_ids).unique()
        return ids

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self.guides.release(request_id)


def _burst_out(
    tokens: torch.Tensor,  # [steps, B] int64: each step's token for every row
    logits: torch.Tensor,  # [steps, B, V] float32: what each was picked from
    seqs: list[ScheduledSeq],
    out: Executed,
) -> Executed:
    """A burst's tokens as each request's kept drafts and its last token (the update appends
    them in turn, and each may end the request: burst.py), with their logprobs where asked."""
    out.steps = tokens.shape[0]
    for i, (s, row) in enumerate(zip(seqs, tokens.t().tolist(), strict=True)):
        rid, top = s.request.request_id, s.request.sampling.logprobs
        lps: list[Logprob | None] = [None] * len(row)
        if top is not None:  # as `sample` reports them, from the same rows of logits
            got = logprobs_of(logits[:, i], row, top)
            out.logprobs[rid], lps = got[-1], [*got]
        out.kept[rid] = list(zip(row[:-1], lps[:-1], strict=True))
        out.sampled[rid] = row[-1]
    return out


def _banned(req: Request) -> tuple[int, ...]:
    """The tokens `req` may not choose now: while it has fewer than min_tokens, every token
    that would stop it; and each bad word's last token where the output ends with the rest of
    the word."""
    sp = req.sampling
    out = req.output_token_ids
    banned: tuple[int, ...] = ()
    if len(out) < sp.min_tokens:
        banned = sp.stop_token_ids + (() if sp.ignore_eos else req.eos_token_ids)
    for word in sp.bad_words:
        k = len(word) - 1
        if k == 0 or (len(out) >= k and tuple(out[-k:]) == word[:-1]):
            banned += (word[-1],)
    return banned
