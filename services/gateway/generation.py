"""One request's choices, running: token event streams -> text deltas with stop strings applied.

A `ChoiceRun` is one generation on an attention server (one choice of one prompt).
`ChoiceStreams` runs all of a request's choices as tasks feeding one queue, so the HTTP side
reads their deltas in arrival order, and cancels every one of them (aborting them on their
attention servers) when it is closed early: a stop string, an error in a sibling, or the client
going away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from afd.control import Logprob, SamplingParams
from services.gateway.balancer import Balancer
from services.gateway.client import AttentionClient
from services.gateway.detok import IncrementalDetokenizer, StopMatcher
from services.gateway.errors import APIError, internal
from services.gateway.latency import ChoiceTiming


@dataclass(frozen=True)
class ChoiceSpec:
    index: int  # the choice's index in the response
    request_id: str  # unique on the attention server
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    prefix: str = ""  # text emitted before the generated text (completions' echo)
    # the echoed prompt's tokens carry their logprobs (the first token's is null)
    echo_logprobs: bool = False
    keep_special_tokens: bool = False  # in the text (a harmony answer's reader needs them)
    # the stop string, or the EOS or stop token, that ended the output stays in its text
    include_stop: bool = False


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # first delta, when asked
    # vLLM's: the stop string or stop token id that ended the choice (None: EOS, length, ...)
    stop_reason: int | str | None = None


@dataclass
class Piece:
    """A chat delta's text, read (services/gateway/answers.py): its reasoning, its content and
    the tool calls it completed or continued (OpenAI's `tool_calls` deltas)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ChoiceRun:
    """One choice: a generation on the least-loaded attention server, as text deltas.

    A server that turns out to be down or draining before it sent anything is reported to the
    balancer and the call goes to another one; once tokens have flowed, a broken stream is the
    choice's error (503, or an error event on a stream already started).
    """

    def __init__(
        self, spec: ChoiceSpec, balancer: Balancer, decoder, timing: ChoiceTiming | None = None
    ) -> None:
        self.spec = spec
        self._balancer = balancer
        self._decoder = decoder  # afd.tokenizer.ModelTokenizer
        self._timing = timing
        self.prompt_tokens = len(spec.prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the attention server's prefix cache supplied
        self.finish_reason: str | None = None
        self._started = False  # the current server has sent something: no retry elsewhere
        self._echoed = False  # the prompt and its logprobs went out (echo with logprobs)

    async def run(self, emit: Callable[[Delta], None]) -> None:
        """Call `emit` with each delta; the last has finish_reason set."""
        if self.spec.prefix and not self.spec.echo_logprobs:
            emit(Delta(self.spec.index, self.spec.prefix))
        tried: tuple[AttentionClient, ...] = ()
        client = self._balancer.pick(prompt=self.spec.prompt_ids)
        while True:
            tried += (client,)
            self._started = False
            try:
                return await self._run_on(client, emit)
            except APIError as e:
                retry = await self._balancer.failed(client, e)
                if self._started or not retry:
                    raise
                try:
                    client = self._balancer.pick(exclude=tried, prompt=self.spec.prompt_ids)
                except APIError:
                    raise e from None

    async def _run_on(self, client: AttentionClient, emit: Callable[[Delta], None]) -> None:
        spec = self.spec
        detok = IncrementalDetokenizer(
            self._decoder, spec.prompt_ids, skip_special_tokens=not spec.keep_special_tokens
        )
        stop = StopMatcher(spec.stop, spec.include_stop)
        ids: list[int] = []
        lps: list[Logprob] = []
        with self._balancer.lease(client):
            stream = client.generate(spec.request_id, spec.prompt_ids, spec.params)
            async with aclosing(stream) as events:  # closing early cancels the call
                async for ev in events:
                    self._started = True
                    if self._timing is not None:
                        self._timing.event(len(ev.token_ids), ev.queue_seconds)
                    self.completion_tokens = ev.completion_tokens
                    self.cached_tokens = ev.cached_tokens
                    if ev.prompt_logprobs or (spec.echo_logprobs and not self._echoed):
                        emit(self._echo(ev.prompt_logprobs))
                    ids += ev.token_ids
                    lps += ev.logprobs
                    finish = ev.finish_reason or None
                    # as vLLM: the token that ended the output is not its text
                    drop = ev.stop_token and bool(ev.token_ids) and not spec.include_stop
                    text = detok.add(ev.token_ids[:-1] if drop else ev.token_ids)
                    text += detok.flush() if finish else ""
                    if ev.completion_tokens <= spec.params.min_tokens:
                        out, stopped = text, False  # no stop string before min_tokens
                    else:
                        out, stopped = stop.feed(text)
                    reason: int | str | None = None
                    if stopped:
                        finish, reason = "stop", stop.matched
                    elif finish:
                        out += stop.flush()
                        last = ev.token_ids[-1] if ev.stop_token and ev.token_ids else None
                        reason = last if last in spec.params.stop_token_ids else None
                    # Every token is sent as it comes, as vLLM streams do, even while its text
                    # waits for the rest of a UTF-8 character or a possible stop string: a
                    # client times tokens by chunks.
                    if ids or out or finish:
                        emit(Delta(spec.index, out, ids, lps, finish, stop_reason=reason))
                        ids, lps = [], []
                    if finish:
                        self.finish_reason = finish
                        if self._timing is not None:
                            self._timing.finish(self.completion_tokens)
                        return

    def _echo(self, prompt_lps: list[Logprob]) -> Delta:
        """The first delta of a choice asking for prompt logprobs: the echoed prompt with
        an entry per prompt token (the first has no logprob: nothing comes before it)."""
        spec = self.spec
        self._echoed = True
        if not spec.echo_logprobs:
            return Delta(spec.index, "", prompt_logprobs=prompt_lps)
        first = Logprob(spec.prompt_ids[0], None, None)  # type: ignore[arg-type]
        return Delta(spec.index, spec.prefix, [], [first, *prompt_lps], None, prompt_lps)


_DONE = object()  # one choice finished
_GONE = object()  # the client disconnected


class ChoiceStreams:
    """All choices of one request, their deltas interleaved on one queue."""

    def __init__(self, runs: list[ChoiceRun], choices_per_prompt: int = 1) -> None:
        self.runs = runs
        self._per_prompt = max(1, choices_per_prompt)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = len(runs)
        self.disconnected = False
        self.texts: list[list[str]] = [[] for _ in runs]  # each choice's text (when logged)
        self.log: Callable[[ChoiceStreams], None] | None = None  # told when all have finished

    def start(self, disconnect: Callable[[], Awaitable[None]] | None = None) -> None:
        """Start every choice; `disconnect`, when given, returns once the client has gone,
        which ends the stream (`next` returns None) and cancels every choice."""
        self._tasks = [asyncio.create_task(self._drive(r)) for r in self.runs]
        if disconnect is not None:
            self._tasks.append(asyncio.create_task(self._watch(disconnect)))

    async def _watch(self, disconnect: Callable[[], Awaitable[None]]) -> None:
        await disconnect()
        self.disconnected = True
        # Cancel right here: whoever reads the queue may never run again (a response that
        # had not started when the client left is simply dropped).
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self._queue.put_nowait(_GONE)

    async def _drive(self, run: ChoiceRun) -> None:
        try:
            await run.run(self._queue.put_nowait)
            if run.finish_reason is None:
                raise internal("a choice ended without a finish reason")
            self._queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except APIError as e:
            self._queue.put_nowait(e)
        except Exception as e:  # report, never hang the reader
            self._queue.put_nowait(internal(f"generation failed: {e}"))

    async def next(self) -> Delta | None:
        """The next delta of any choice; None when every choice has finished. Raises the
        first APIError a choice hit."""
        while self._open:
            item = await self._queue.get()
            if item is _GONE:
                await self.close()
                return None
            if item is _DONE:
                self._open -= 1
                continue
            if isinstance(item, APIError):
                await self.close()
                raise item
            if self.log is not None:  # kept only for the output log
                self.texts[item.index].append(item.text)
            return item
        return None

    async def close(self) -> None:
        """Cancel every choice still running (their attention servers abort them)."""
        self._open = 0
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per distinct prompt, as OpenAI counts them."""
        seen = {r.spec.index // self._per_prompt: r.prompt_tokens for r in self.runs}
        return sum(seen.values())

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.runs)

    @property
    def cached_tokens(self) -> int:
        """Cached prompt tokens, counted like the prompt tokens: once per distinct prompt (the
        first choice's)."""
        first = [r for r in self.runs if r.spec.index % self._per_prompt == 0]
        return sum(r.cached_tokens for r in first)
