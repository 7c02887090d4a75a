"""Beam search as vLLM serves it (`use_beam_search`, `length_penalty`; `n` is the beam width),
made in the gateway out of one-token generations.

Each step asks the attention servers for one token of every live beam with the top 2 x width
log-probabilities (the prefix cache supplies the K/V the beams share; more when the request
asks for more logprobs, which then come from the same answers). Over all beams'
candidates, each scored by its beam's cumulative log-probability plus its own: an EOS candidate
(unless `ignore_eos`) ends a finished hypothesis; the best `width` of the others are the next
step's beams. After `max_tokens` steps the finished hypotheses and the live beams are ranked by
cumulative log-probability / (prompt + output length) ** length_penalty, and the best `width`
are the choices. The log-probabilities are the model's own: sampling fields do not apply.

`BeamChoice` is one of those choices as a `ChoiceStreams` run: the choices of one prompt share
one search (the first of them runs it), and each sends its text in one delta at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from afd.control import Logprob, SamplingParams
from services.gateway.balancer import Balancer
from services.gateway.client import AttentionClient
from services.gateway.errors import APIError, internal, invalid
from services.gateway.generation import ChoiceSpec, Delta
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

# what a beam search cannot honour: it reads only the model's own log-probabilities and
# answers once at the end (vLLM ignores most of these; here they are the client's 400)
_UNSUPPORTED = (
    "prompt_logprobs", "echo", "stop", "stop_token_ids",
    "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_p", "min_tokens", "bad_words", "allowed_token_ids", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "continue_final_message",
)  # fmt: skip


def check_request(req: ChatCompletionRequest | CompletionRequest) -> None:
    """A beam-search request asks nothing of what the search cannot do."""
    fields = type(req).model_fields
    # set to something that matters (a client sending the neutral value is welcome)
    given = [
        f
        for f in _UNSUPPORTED
        if f in fields and getattr(req, f) not in (fields[f].default, None, False, [], {})
    ]
    if isinstance(req, ChatCompletionRequest) and req.tool_mode in ("required", "named"):
        given.append("tool_choice")
    if given:
        raise invalid(f"beam search does not take {', '.join(given)}", given[0])


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # generated tokens (an ending EOS only with include_stop)
    cum_logprob: float
    logprobs: tuple[Logprob, ...] = ()  # one per token, when asked
    finish_reason: str = "length"  # "stop": it ended on EOS
    stop_reason: int | None = None  # that EOS


@dataclass(frozen=True)
class BeamOptions:
    width: int
    length_penalty: float
    eos_token_id: int | None  # the tokenizer's, as vLLM takes it; None: nothing ends a beam
    ignore_eos: bool = False
    include_stop: bool = False  # a finished beam's tokens end with its EOS
    logprobs: int | None = None  # alternatives per token to report (None: no logprobs)


def score(beam: Beam, prompt_len: int, length_penalty: float, eos: int | None) -> float:
    """vLLM's ranking: the cumulative log-probability over the whole sequence's length (the
    prompt's too; an ending EOS not counted) to the power length_penalty."""
    n = prompt_len + len(beam.tokens)
    if beam.tokens and beam.tokens[-1] == eos:
        n -= 1
    return beam.cum_logprob / max(n, 1) ** length_penalty


async def search(balancer: Balancer, spec: ChoiceSpec, opts: BeamOptions) -> list[Beam]:
    """The `width` best hypotheses for `spec`'s prompt after its max_tokens steps, best
    first."""
    step_params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,  # the step's token is never used: only its alternatives are read
        logprobs=max(2 * opts.width, opts.logprobs or 0),
        cache_salt=spec.params.cache_salt,
        priority=spec.params.priority,
    )
    live = [Beam((), 0.0)]
    done: list[Beam] = []
    for step in range(spec.params.max_tokens):
        tops = await asyncio.gather(
            *(
                _alternatives(balancer, f"{spec.request_id}.s{step}.b{i}", spec, beam, step_params)
                for i, beam in enumerate(live)
            )
        )
        candidates: list[Beam] = []
        for beam, top in zip(live, tops, strict=True):
            search_top = top[: 2 * opts.width]
            shown = top[: opts.logprobs] if opts.logprobs is not None else None
            for token, logprob in search_top:
                cum = beam.cum_logprob + logprob
                lps = beam.logprobs
                if shown is not None:
                    lps += (Logprob(token, logprob, shown),)
                if token == opts.eos_token_id and not opts.ignore_eos:
                    # the EOS, its logprob too, only where it stays among the tokens
                    if opts.include_stop:
                        done.append(Beam(beam.tokens + (token,), cum, lps, "stop", token))
                    else:
                        done.append(Beam(beam.tokens, cum, beam.logprobs, "stop", token))
                else:
                    candidates.append(Beam(beam.tokens + (token,), cum, lps))
        # stable: ties keep the beams' order, then the alternatives' rank
        live = sorted(candidates, key=lambda b: -b.cum_logprob)[: opts.width]
        if not live:
            break
    n = len(spec.prompt_ids)
    ranked = sorted(
        done + live,
        key=lambda b: -score(b, n, opts.length_penalty, opts.eos_token_id),
    )
    return ranked[: opts.width]


async def _alternatives(
    balancer: Balancer,
    request_id: str,
    spec: ChoiceSpec,
    beam: Beam,
    params: SamplingParams,
) -> list[tuple[int, float]]:
    """The next token's top alternatives (id, log-probability) after `beam`. A step sends the
    client nothing, so where a server fails on its own account (gone, draining) it is asked of
    another, as a choice that has not started is."""
    tried: tuple[AttentionClient, ...] = ()
    client = balancer.pick(prompt=spec.prompt_ids)
    while True:
        tried += (client,)
        try:
            return await _step_on(balancer, client, request_id, spec, beam, params)
        except APIError as e:
            if not await balancer.failed(client, e):
                raise
            try:
                client = balancer.pick(exclude=tried, prompt=spec.prompt_ids)
            except APIError:
                raise e from None


async def _step_on(
    balancer: Balancer,
    client: AttentionClient,
    request_id: str,
    spec: ChoiceSpec,
    beam: Beam,
    params: SamplingParams,
) -> list[tuple[int, float]]:
    top: list[tuple[int, float]] | None = None
    with balancer.lease(client):
        stream = client.generate(request_id, [*spec.prompt_ids, *beam.tokens], params)
        async with aclosing(stream) as events:
            async for ev in events:
                if ev.logprobs:
                    top = list(ev.logprobs[0].top)
    if top is None:
        raise internal("a beam-search step came back without log-probabilities")
    return top


class BeamChoice:
    """Choice `rank` of a prompt's beam search, run as ChoiceStreams runs a ChoiceRun."""

    def __init__(
        self,
        spec: ChoiceSpec,
        rank: int,
        shared: asyncio.Future,
        start: Callable[[], Awaitable[None]] | None,
        decode: Callable[[list[int], bool], str],
    ) -> None:
        self.spec = spec
        self._rank = rank
        self._shared = shared  # the prompt's search: its beams, best first
        self._start = start  # the first choice of a prompt runs the search
        self._decode = decode
        self.prompt_tokens = len(spec.prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None

    async def run(self, emit: Callable[[Delta], None]) -> None:
        if self._start is not None:
            await self._start()
        beams = await self._shared
        if self._rank >= len(beams):  # fewer hypotheses than choices (a tiny vocabulary)
            self.finish_reason = "length"
            emit(Delta(self.spec.index, "", finish_reason="length"))
            return
        beam = beams[self._rank]
        tokens = list(beam.tokens)
        text_ids = (
            tokens[:-1] if beam.finish_reason == "stop" and self.spec.include_stop else tokens
        )
        text = self._decode(text_ids, not self.spec.keep_special_tokens)
        self.completion_tokens = len(tokens)
        self.finish_reason = beam.finish_reason
        # as vLLM's beam search: an EOS that ended a beam is its stop_reason
        lps = list(beam.logprobs)
        emit(Delta(self.spec.index, text, tokens, lps, beam.finish_reason, [], beam.stop_reason))


def beam_choices(
    specs: list[ChoiceSpec],
    n: int,
    balancer: Balancer,
    opts: BeamOptions,
    decode: Callable[[list[int], bool], str],
) -> list[BeamChoice]:
    """The runs of a beam-search request: `n` choices per prompt, each prompt searched once."""
    runs = []
    for first in range(0, len(specs), n):
        spec = specs[first]
        loop = asyncio.get_running_loop()
        shared: asyncio.Future = loop.create_future()

        async def start(spec=spec, shared=shared) -> None:
            try:
                shared.set_result(await search(balancer, spec, opts))
            except asyncio.CancelledError:
                shared.cancel()
                raise
            except Exception as e:  # every choice of the prompt fails with it
                shared.set_exception(e)
                raise

        for rank in range(n):
            runs.append(
                BeamChoice(specs[first + rank], rank, shared, start if rank == 0 else None, decode)
            )
    return runs
