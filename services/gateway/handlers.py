"""From a validated OpenAI request to a response: prompts -> token ids, checks against the
context, one generation per choice, then a JSON body or an SSE stream."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from afd import metrics
from afd.tokenizer import ModelTokenizer
from services.gateway.answers import Reader, answer_readers, read_delta, read_whole
from services.gateway.balancer import Balancer
from services.gateway.beam_search import BeamOptions, beam_choices
from services.gateway.beam_search import check_request as check_beam_request
from services.gateway.detok import TokenBytes
from services.gateway.errors import APIError, invalid, validation_message
from services.gateway.generation import ChoiceRun, ChoiceSpec, ChoiceStreams, Delta
from services.gateway.latency import SLA, ChoiceTiming
from services.gateway.lifecycle import Lifecycle
from services.gateway.request_log import RequestLog
from services.gateway.response_store import ResponseStore
from services.gateway.responses import (
    SSE_DONE,
    ChatFormatter,
    CompletionFormatter,
    sse,
    usage,
)
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class GatewayState:
    """What every handler needs; built once at start-up."""

    tokenizer: ModelTokenizer
    token_bytes: TokenBytes
    balancer: Balancer
    model_name: str  # the name responses carry
    vocab_size: int  # token ids must be below this (the model's embedding rows)
    notice: str = ""  # shown on the model card (the demo model says its text is meaningless)
    sla: SLA = SLA()  # latency targets the SLA-attainment counters check
    template_timeout_s: float = 2.0  # chat-template rendering, at most
    max_tokens_limit: int = 0  # max_tokens, at most (0: whatever the context leaves)
    startup_wait_s: float = 0.0  # a request while the cluster starts waits this long for it
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # draining on SIGTERM
    # tool_choice "auto" reads calls with this parser (services/gateway/tool_parsers.py);
    # "": auto tool choice is off
    tool_parser: str = ""
    # a chat answer's thinking goes out as reasoning_content (services/gateway/reasoning.py)
    reasoning_parser: str = ""
    chat_format: str = "text"  # the model's (afd.config.ModelConfig.chat_format)
    # request field -> its default where the request leaves it out (model_defaults.py)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = 20  # alternatives a request may ask for (-1: the vocabulary)
    # chat-template variables a chat gets unless it sets them (--default-chat-template-kwargs)
    chat_template_defaults: dict[str, Any] = field(default_factory=dict)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))  # Responses API
    model_aliases: tuple[str, ...] = ()  # further names a request may use for the model
    request_log: RequestLog | None = None  # --enable-log-requests
    force_include_usage: bool = False  # every stream ends with its usage
    tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"


async def parse(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body as `model`; malformed JSON or a field of the wrong type or range is a 400."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # deeper than Python's stack: no request needs that
        raise invalid("the body's JSON is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e.errors(include_url=False))
        raise invalid(msg, param=param) from None


def check_model(state: GatewayState, name: str | None) -> None:
    names = (state.model_name, *state.model_aliases)
    if name is not None and name not in names:
        served = " or ".join(map(repr, names))
        raise invalid(
            f"the model {name!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )


async def respond(
    state: GatewayState,
    request: Request,
    req: ChatCompletionRequest | CompletionRequest,
    specs: list[ChoiceSpec],
) -> Response:
    """Run the choices and answer: an SSE stream or one JSON body."""
    chat = isinstance(req, ChatCompletionRequest)
    rid = request.state.request_id
    fmt_cls = ChatFormatter if chat else CompletionFormatter
    # vLLM's --enable-force-include-usage: every stream ends with its usage
    include_usage = req.include_usage or (req.stream and state.force_include_usage)
    fmt = fmt_cls(
        f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        state.model_name,
        state.token_bytes,
        include_usage,
    )
    fmt.ids_as_tokens = req.return_tokens_as_token_ids or state.tokens_as_token_ids
    beams = None
    if req.use_beam_search:
        check_beam_request(req)
        beams = BeamOptions(
            req.n, req.length_penalty, state.tokenizer.eos_token_id, req.ignore_eos,
            req.include_stop_str_in_output, req.num_logprobs,
        )  # fmt: skip
    streams = start_choices(state, request, specs, req.n, beams)
    if req.continuous_usage:
        fmt.usage_so_far = lambda: usage(
            streams.prompt_tokens, streams.completion_tokens, streams.cached_tokens
        )
    with_lp = req.num_logprobs is not None
    readers = answer_readers(
        req, state.tool_parser, state.reasoning_parser, len(specs), state.chat_format,
        guide_waits=any(s.params.guide_after for s in specs),
    )  # fmt: skip
    echo = req.echoed if isinstance(req, ChatCompletionRequest) else ""
    if req.stream:
        return await event_stream(
            streams,
            lambda first: _sse(
                streams,
                fmt,
                first,
                with_lp,
                chat,
                include_usage,
                readers,
                echo,
                specs if req.return_token_ids else None,
            ),
        )
    choices, prompt_lps, reasons, ids = await collect(streams, len(specs))
    if streams.disconnected:
        return Response(status_code=499)  # nobody is listening any more
    use = usage(streams.prompt_tokens, streams.completion_tokens, streams.cached_tokens)
    count_finished(streams)
    if readers is not None:
        assert isinstance(fmt, ChatFormatter)
        choices, answers = read_whole(choices, readers)
        choices = [(echo + text, lps, finish) for text, lps, finish in choices]
        body = fmt.response(choices, with_lp, use, answers)
    else:
        choices = [(echo + text, lps, finish) for text, lps, finish in choices]
        body = fmt.response(choices, with_lp, use)
    body = _stop_reasons(body, reasons)
    if req.return_token_ids:
        _token_ids(body, chat, specs, ids)
    if isinstance(req, CompletionRequest) and req.prompt_logprobs is not None:
        assert isinstance(fmt, CompletionFormatter)
        fmt.add_prompt_logprobs(body, [prompt_lps[s.index] for s in specs])
    elif chat and req.prompt_logprobs is not None:  # vLLM's: the one prompt's, at the top
        body["prompt_logprobs"] = fmt.prompt_logprobs(prompt_lps[0])
    return JSONResponse(body)


async def event_stream(
    streams: ChoiceStreams, events: Callable[[Delta | None], AsyncIterator[bytes]]
) -> StreamingResponse:
    """An SSE response of `events(first delta)`: waiting for the first delta before anything
    is sent, so an error then still gets its HTTP status."""
    try:
        first = await streams.next()
    except BaseException:
        await streams.close()
        raise
    return StreamingResponse(
        events(first),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def start_choices(
    state: GatewayState,
    request: Request,
    specs: list[ChoiceSpec],
    n: int,
    beams: BeamOptions | None = None,
    watch_client: bool = True,  # False: it runs on when the client leaves (a background one)
) -> ChoiceStreams:
    """Every choice running, their deltas on one stream that ends if the client leaves; with
    `beams`, the choices are the best hypotheses of each prompt's beam search."""
    t_arrival = getattr(request.state, "t_arrival", None) or time.perf_counter()
    if beams is not None:
        runs: list = beam_choices(specs, n, state.balancer, beams, state.tokenizer.decode)
    else:
        runs = [
            ChoiceRun(s, state.balancer, state.tokenizer, ChoiceTiming(t_arrival, state.sla))
            for s in specs
        ]
    streams = ChoiceStreams(runs, n)
    if state.request_log is not None:
        state.request_log.received(request.state.request_id, specs)
        streams.log = state.request_log.finished if state.request_log.outputs else None
    streams.start((lambda: _disconnected(request)) if watch_client else None)
    return streams


async def collect(
    streams: ChoiceStreams, n: int
) -> tuple[list[tuple[str, list, str]], list[list], list[int | str | None], list[list[int]]]:
    """Each choice's (text, logprobs, finish reason), its prompt logprobs, stop reason and
    token ids."""
    texts: list[list[str]] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    prompt_lps: list[list] = [[] for _ in range(n)]
    finish = [""] * n
    reasons: list[int | str | None] = [None] * n
    try:
        while (d := await streams.next()) is not None:
            texts[d.index].append(d.text)
            ids[d.index] += d.token_ids
            lps[d.index] += d.logprobs
            prompt_lps[d.index] += d.prompt_logprobs
            finish[d.index] = d.finish_reason or finish[d.index]
            reasons[d.index] = d.stop_reason if d.finish_reason else reasons[d.index]
    finally:
        await streams.close()
    choices = [("".join(texts[i]), lps[i], finish[i]) for i in range(n)]
    return choices, prompt_lps, reasons, ids


def _token_ids(body: dict, chat: bool, specs: list[ChoiceSpec], ids: list[list[int]]) -> None:
    """vLLM's return_token_ids: each choice's token ids and its prompt's (a chat's at the top,
    a completion's in each choice)."""
    if chat:
        body["prompt_token_ids"] = specs[0].prompt_ids
    for choice in body["choices"]:
        i = choice["index"]
        choice["token_ids"] = ids[i]
        if not chat:
            choice["prompt_token_ids"] = specs[i].prompt_ids


def _stop_reasons(body: dict, reasons: list[int | str | None]) -> dict:
    """vLLM's stop_reason in each choice: the stop string or token id that ended it."""
    for choice in body["choices"]:
        choice["stop_reason"] = reasons[choice["index"]]
    return body


async def _sse(
    streams: ChoiceStreams,
    fmt: ChatFormatter | CompletionFormatter,
    first: Delta | None,
    with_lp: bool,
    chat: bool,
    include_usage: bool,
    readers: list[Reader] | None = None,
    echo: str = "",
    id_specs: list[ChoiceSpec] | None = None,  # return_token_ids: the choices' prompts
) -> AsyncIterator[bytes]:
    sent: set[int] = set()  # choices whose prompt ids went out
    try:
        if chat:
            for i in range(len(streams.runs)):
                yield sse(fmt.role_chunk(i))
                if echo:  # vLLM's chat echo: the assistant's last text, then the answer
                    yield sse(fmt.chunk(Delta(i, echo), False))
        d = first
        while d is not None:
            if readers is not None:
                assert isinstance(fmt, ChatFormatter)
                d, piece = read_delta(readers[d.index], d)
                chunk = fmt.chunk(d, with_lp, piece.calls, piece.reasoning)
            else:
                chunk = fmt.chunk(d, with_lp)
            if id_specs is not None:  # vLLM's: each chunk's tokens, the prompt's in the first
                chunk["choices"][0]["token_ids"] = d.token_ids
                if d.index not in sent:
                    sent.add(d.index)
                    where = chunk if chat else chunk["choices"][0]
                    where["prompt_token_ids"] = id_specs[d.index].prompt_ids
            yield sse(chunk)
            d = await streams.next()
        if streams.disconnected:
            return
        count_finished(streams)
        if include_usage:
            yield sse(
                fmt.usage_chunk(
                    streams.prompt_tokens, streams.completion_tokens, streams.cached_tokens
                )
            )
    except APIError as e:  # the status line is gone; the error travels as an event
        yield sse(e.body())
    finally:
        await streams.close()
    yield SSE_DONE


async def _disconnected(request: Request) -> None:
    """Returns once the client has hung up (the body was read already, so the next ASGI
    message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def count_finished(streams: ChoiceStreams) -> None:
    if streams.log is not None:
        streams.log(streams)
    metrics.PROMPT_TOKENS.inc(streams.prompt_tokens)
    metrics.GENERATION_TOKENS.inc(streams.completion_tokens)
    for r in streams.runs:
        if r.finish_reason:
            metrics.REQUEST_SUCCESS.labels(finished_reason=r.finish_reason).inc()
