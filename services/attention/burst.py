"""Bursts: several decode steps in one native call (vLLM's multi-step scheduling).

Where the decode step is one native call (stack.py), what is left of a step at batch 1 is the
Python around that call: scheduling, the batch's tensors, the call's arguments, the update and
its events, a tenth of the step on a fast box. Where nothing but the request's own logits and
sampling parameters decides each next token, the call itself can go on: it feeds each step's
tokens to the next (decode_stack.c: afd_bf16_decode_burst), a greedy row's argmax or a sampled
row's draw (sample.c: temperature, min-p, top-k, top-p, from uniform numbers drawn before the
call from torch's global generator), and the Python runs once for the burst. The update then
takes each request's tokens as a speculating request's kept drafts (scheduler.update: each one
may end it; what a burst computed after an end is dropped, and its K/V lies in the request's
own blocks, freed with it).

A burst is planned after the step's schedule (`extend`) and only where:
- every scheduled request decodes one token (no prefill, no drafts) with nothing that changes
  its logits (penalties, biases, banned or allowed tokens, a grammar, min_tokens still to
  come); logprobs are read from each step's logits afterwards;
- a sampled request has no seed of its own and the engine's generator none either
  (--sampling-seed): a burst's draws differ from a step's, and its length follows the box's
  speed, so a seeded request's tokens would change from run to run;
- no request is waiting: a burst delays the next admission by its length;
- every request has room for the burst's tokens (max_tokens, the context) and its blocks for
  them can be allocated without a preemption.

Its length is the configured cap (`--num-scheduler-steps`), bounded by `Policy` so that a burst
takes at most BUDGET_S of the recent step time: at batch 1 a few steps, at batch 32 (where the
Python is a small part of a longer step) one. Where the stack cannot run the burst (the shard is
remote, the head is not in the call), the step runs one step and the blocks stay allocated to
their requests, which fill them next.
"""

from __future__ import annotations

from dataclasses import replace

from services.attention.request import Request
from services.attention.scheduler import Scheduler, SchedulerOutput
from services.attention.speculative import room

# The longest a burst may take (and so delay the admission of a request that arrives during it)
BUDGET_S = 0.025


class Policy:
    """A burst's length: up to `cap` steps, as many as fit BUDGET_S at the recent step time."""

    def __init__(self, cap: int):
        self.cap = cap
        self._step_s = 0.0  # a decode step's time, a moving average; 0: none seen yet

    def steps(self) -> int:
        if self.cap <= 1 or self._step_s <= 0.0:
            return 1  # the first step is measured before any burst
        return max(1, min(self.cap, int(BUDGET_S / self._step_s)))

    def observe(self, seconds: float, steps: int) -> None:
        """A decode-only step took `seconds` for `steps` steps."""
        per = seconds / max(steps, 1)
        self._step_s = per if self._step_s <= 0.0 else 0.8 * self._step_s + 0.2 * per


def extend(
    scheduler: Scheduler, plan: SchedulerOutput, steps: int, sampled: bool = True
) -> SchedulerOutput:
    """`plan` with each scheduled request's burst set (and its blocks allocated) where the
    whole step may run `steps` > 1 steps in one call; else `plan` as it is. `sampled`: whether
    unseeded sampled requests may burst (the engine's generator has no seed)."""
    if steps <= 1 or not plan.scheduled or scheduler.num_waiting or plan.preempted:
        return plan
    n = steps
    for s in plan.scheduled:
        if s.num_new_tokens != 1 or not s.sample or s.draft_ids or not _plain(s.request, sampled):
            return plan
        n = min(n, room(s.request, scheduler.max_model_len) + 1)
    if n <= 1:
        return plan
    for s in plan.scheduled:  # blocks for the positions start .. start + n - 1
        if not scheduler.grow(s.request, n):
            return plan  # no preemption for a burst: the blocks taken are filled later
    bursting = [replace(s, block_ids=list(s.request.block_ids), burst=n) for s in plan.scheduled]
    return replace(plan, scheduled=bursting)


def _plain(req: Request, sampled: bool) -> bool:
    """Nothing but the logits and the sampling parameters decide the next token: greedy, or
    (`sampled`) drawn without a seed (logprobs are read from each step's logits after the
    call: runner.py)."""
    sp = req.sampling
    return (
        (sp.greedy or (sampled and sp.seed is None))
        and not sp.adjusts_logits
        and not sp.allowed_token_ids
        and not sp.bad_words
        and not sp.guide_kind
        and len(req.output_token_ids) >= sp.min_tokens
    )
