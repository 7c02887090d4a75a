"""Continuous-batching scheduler of the attention server (plain Python, no torch).

Unified token-budget scheduling in the style of vLLM v1: a request is just `num_computed_tokens`
(K/V already in the cache) chasing `num_tokens` (prompt + output). Each step it is scheduled for
the difference, so a decode is 1 token, a prefill is the prompt, and a long prompt is split into
chunks when it exceeds the step's token budget. There is no separate prefill/decode phase.

The step is three verbs: `schedule()` emits a plain-data plan, the runner executes it, and
`update()` applies the sampled tokens. Under KV-cache pressure running requests are preempted by
recompute: their blocks are freed and they rejoin the waiting queue ahead of those who came
after them, to be re-prefilled (prompt + output so far) later.

With prefix caching a request admitted from the queue starts from the longest chain of cached
full blocks of its tokens (`num_computed_tokens` starts there) and every block it fills is
registered in `update()`; at least its last token is always computed, since sampling needs its
hidden state. A request asking for prompt logprobs computes its whole prompt (each position's
logits are needed) and still leaves its blocks in the cache.

With speculative decoding (speculative.py) a decoding request's chunk is its last token and its
drafts; `update()` counts the drafts the runner kept as computed and appends them as output, as
it does a burst's tokens (burst.py: decode steps in one call, planned after `schedule()`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from afd import prefix
from afd.config import SchedulerConfig
from afd.control import Logprob
from afd.errors import ConfigError, RequestError
from services.attention.admission import check_backpressure, check_fits_pool
from services.attention.block_manager import BlockManager
from services.attention.request import Request, RequestStatus
from services.attention.speculative import NgramDrafter, room
from services.attention.waiting import WaitingQueue, victim


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: compute K/V for `token_ids` at positions start_pos.."""

    request: Request
    token_ids: list[int]  # req.all_token_ids[start_pos:], as many as computed (+ drafts)
    start_pos: int  # num_computed_tokens before this step
    block_ids: list[int]  # the request's full block table after allocation (a copy)
    sample: bool  # last chunk: the runner must sample a token for this request
    # speculative decoding: the guessed tokens after the last one, the tail of token_ids
    draft_ids: tuple[int, ...] = ()
    burst: int = 1  # decode steps in one call, their blocks allocated (burst.py)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[str]  # request ids preempted (blocks freed) during this step
    num_batched_tokens: int


class Scheduler:
    """Continuous batching over a `BlockManager`, bounded by `max_num_seqs` requests and
    `max_num_batched_tokens` tokens per step; admission and preemption follow the config's
    policy (first come first served, or by priority: services/attention/waiting.py)."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        prefix_caching: bool = False,
        drafter: NgramDrafter | None = None,
    ) -> None:
        if max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
        # Without chunking a prefill must fit in one step; a recompute after preemption can be
        # up to max_model_len - 1 tokens, so a smaller budget could strand a request forever.
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({max_model_len}) when chunked prefill is disabled"
            )
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self._waiting = WaitingQueue(config.scheduling_policy)
        self._running: list[Request] = []  # admission order
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_preemptions = 0  # since the start, all requests together
        self.prefix_caching = prefix_caching
        self.drafter = drafter  # speculative decoding (speculative.py), or None
        # prompt tokens of admitted requests, and how many of them the prefix cache supplied
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def add_request(self, req: Request) -> None:
        """Validate and queue a new request; raises RequestError if it cannot be served."""
        n = req.num_prompt_tokens
        if req.sampling.priority and self.config.scheduling_policy != "priority":
            raise RequestError(
                f"priority {req.sampling.priority} was given but this server schedules first "
                "come, first served (start it with --scheduling-policy priority)"
            )
        if n == 0:
            raise RequestError("the prompt is empty: at least one token is needed")
        if n >= self.max_model_len:
            raise RequestError(
                f"prompt has {n} tokens; the context is {self.max_model_len} tokens "
                "(the prompt must be shorter to leave room for at least one new token)"
            )
        if req.sampling.max_tokens < 0:
            raise RequestError(f"max_tokens must be >= 0, got {req.sampling.max_tokens}")
        if req.request_id in self._requests:
            raise RequestError(f"request id {req.request_id!r} is already in use")
        if req.status is not RequestStatus.WAITING or req.num_computed_tokens or req.block_ids:
            raise RequestError(f"request {req.request_id!r} is not fresh (status {req.status})")
        check_fits_pool(self.block_manager, req, self.max_model_len)
        check_backpressure(self.config, self._waiting, n)
        self._waiting.add(req)
        self._requests[req.request_id] = req

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its blocks now.

        Returns False (never raises) for an unknown or already finished id, so a cancel that
        races a natural finish is harmless.
        """
        req = self._requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._finish(req, "abort")
        return True

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (in order), then admit waiting ones (in the
        policy's order)."""
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, preempted)
        # After a preemption the pool is under pressure and the preempted requests sit at the
        # head of the queue; admitting anything now would only preempt again next step.
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled)
        used = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(scheduled=scheduled, preempted=preempted, num_batched_tokens=used)

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledSeq], preempted: list[str]
    ) -> int:
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                i += 1
                continue
            drafts = self._drafts(req, n, budget)
            # Preempt the policy's victim until this request's blocks fit. Under fcfs that is
            # the tail, never a request already planned this step (those sit before index i);
            # under priority it may be one, whose plan is then taken back.
            while not self.grow(req, n):
                out = victim(self._running, self.config.scheduling_policy)
                planned = self._running.index(out) < i
                self._preempt(out)
                preempted.append(out.request_id)
                if out is req:
                    break
                if planned:
                    k = next(k for k, seq in enumerate(scheduled) if seq.request is out)
                    budget += scheduled.pop(k).num_new_tokens
                    i -= 1
            if req.status is not RequestStatus.RUNNING:
                continue  # it preempted itself: running[i] is the next request now, if any
            scheduled.append(self._plan(req, n, drafts))
            budget -= n + len(drafts)
            i += 1
        return budget

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """A decoding request's drafts, their blocks allocated; none where that would need a
        preemption, or when the step runs more requests than speculation is for."""
        d = self.drafter
        if d is None or n != 1:
            return []
        off = d.cfg.disable_by_batch_size
        if off and len(self._running) > off:
            return []
        drafts = d.propose(req, min(budget - 1, room(req, self.max_model_len)))
        return drafts if drafts and self.grow(req, 1 + len(drafts)) else []

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            req = self._waiting.head()
            self._take_cached_prefix(req)
            n = self._num_new_tokens(req, budget)
            # if the head does not fit (budget or blocks), nobody behind it jumps ahead
            if n == 0 or not self.grow(req, n):
                self._release(req)
                break
            self._waiting.pop_head()
            if req.num_cached_tokens is None:  # first admission: what the cache gave it
                req.num_cached_tokens = req.num_computed_tokens
                self.prefix_queries += req.num_prompt_tokens
                self.prefix_hits += req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self._running.append(req)
            scheduled.append(self._plan(req, n))
            budget -= n
        return budget

    def _take_cached_prefix(self, req: Request) -> None:
        """Start a waiting request from the cached blocks of its longest cached prefix."""
        if not self.prefix_caching or req.prompt_positions_to_score:
            return
        bm = self.block_manager
        # whole blocks, and never the last token: its hidden state is what gets sampled
        limit = (req.num_tokens - 1) // bm.block_size
        if len(req.block_hashes) < limit:
            self._hash(req, limit)
        hit = bm.lookup(req.block_hashes[:limit])
        bm.touch(hit)
        req.block_ids = hit
        req.num_cached_blocks = len(hit)
        req.num_computed_tokens = len(hit) * bm.block_size

    def _cache_blocks(self, req: Request) -> None:
        """Register the blocks this step filled (their K/V is computed now)."""
        if not self.prefix_caching:
            return
        bm = self.block_manager
        full = req.num_computed_tokens // bm.block_size
        if full <= req.num_cached_blocks:
            return
        self._hash(req, full)
        for i in range(req.num_cached_blocks, full):
            bm.register(req.block_ids[i], req.block_hashes[i])
        req.num_cached_blocks = full

    def _hash(self, req: Request, blocks: int) -> None:
        """Extend req.block_hashes to its first `blocks` full blocks (salted, when it is)."""
        salt = req.sampling.cache_salt.encode()
        prefix.extend(
            req.block_hashes, req.all_token_ids, self.block_manager.block_size, blocks, salt
        )

    def _release(self, req: Request) -> None:
        """Give back every block of `req`, tail first (a cached prefix outlives its tail), and
        forget its progress: what is computed again comes from the cache where it still is."""
        self.block_manager.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to compute for `req` this step within `budget`; 0 means it must wait."""
        n = req.num_tokens - req.num_computed_tokens
        if n <= budget:
            return n
        return budget if self.config.enable_chunked_prefill else 0

    def grow(self, req: Request, n: int) -> bool:
        """Make req's block table cover `num_computed_tokens + n` tokens; False if no room."""
        bm = self.block_manager
        missing = bm.blocks_needed(req.num_computed_tokens + n) - len(req.block_ids)
        if missing <= 0:
            return True
        if not bm.can_allocate(missing):
            return False
        req.block_ids.extend(bm.allocate(missing))
        return True

    def _plan(self, req: Request, n: int, drafts: list[int] | tuple[()] = ()) -> ScheduledSeq:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        start = req.num_computed_tokens
        return ScheduledSeq(
            request=req,
            token_ids=req.all_token_ids[start : start + n] + list(drafts),
            start_pos=start,
            block_ids=list(req.block_ids),
            # max_tokens 0: the prompt is only scored (prompt logprobs), nothing is sampled
            sample=start + n == req.num_tokens and req.sampling.max_tokens > 0,
            draft_ids=tuple(drafts),
        )

    def _preempt(self, req: Request) -> None:
        # Recompute, not swap: the K/V is dropped and rebuilt from prompt + output later. The
        # output tokens are kept, so the client sees no difference except latency.
        self._running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.readmit(req)

    def update(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        logprobs: dict[str, Logprob] | None = None,
        prompt_logprobs: dict[str, list[Logprob]] | None = None,
        ended: set[str] | None = None,
        kept: dict[str, list[tuple[int, Logprob | None]]] | None = None,
    ) -> list[Request]:
        """Apply one executed step; returns the requests that got new tokens (to stream), and
        those asking for no token (max_tokens 0) whose prompt is done. `sampled` holds a token
        for every seq with `sample=True`; `ended`: requests that finish ("stop") with it
        whatever it is (their grammar is complete); `kept`: the drafts each speculating request
        keeps, before its sampled token (each may end it). Requests aborted since `schedule()`
        are skipped."""
        new_token: list[Request] = []
        for seq in output.scheduled:
            req = seq.request
            if self._requests.get(req.request_id) is not req or req.finished:
                continue  # aborted while the step ran
            if req.num_computed_tokens != seq.start_pos:
                raise RuntimeError(
                    f"request {req.request_id!r}: step planned at position {seq.start_pos} but "
                    f"{req.num_computed_tokens} tokens are computed (update applied twice?)"
                )
            # drafts count once kept (below); the K/V of the others is overwritten later
            req.num_computed_tokens += seq.num_new_tokens - len(seq.draft_ids)
            if prompt_logprobs and req.request_id in prompt_logprobs:
                req.prompt_logprobs += prompt_logprobs[req.request_id]
            if not seq.sample:
                self._cache_blocks(req)
                if req.sampling.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                    self._running.remove(req)
                    self._finish(req, "length")
                    new_token.append(req)
                continue
            if req.request_id not in sampled:
                raise KeyError(f"no sampled token for request {req.request_id!r}")
            drafts = kept.get(req.request_id, []) if kept else []
            own = logprobs.get(req.request_id) if logprobs else None
            new_token.append(req)
            for i, (token, lp) in enumerate([*drafts, (sampled[req.request_id], own)]):
                req.output_token_ids.append(token)
                req.output_logprobs += [lp] if lp is not None else []
                last = i == len(drafts)
                reason = "stop" if last and ended and req.request_id in ended else None
                reason = reason or self._finish_reason(req)
                req.stop_token = reason == "stop" and _ends_on(req, token)
                if reason is not None:
                    self._running.remove(req)
                    self._finish(req, reason)
                    break
                if not last:
                    req.num_computed_tokens += 1  # a kept draft: its K/V is this step's
            if not req.finished:
                self._cache_blocks(req)
        return new_token

    def _finish_reason(self, req: Request) -> str | None:
        if _ends_on(req, req.output_token_ids[-1]):
            return "stop"
        sp = req.sampling
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        # blocks go back at once so the very next schedule() can use them
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.request_id]
        if self.drafter is not None:
            self.drafter.release(req.request_id)


def _ends_on(req: Request, token: int) -> bool:
    """Whether `token` ends the request: its EOS (unless ignored) or one of its stop tokens."""
    sp = req.sampling
    return (token in req.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids
