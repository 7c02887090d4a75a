"""From a validated OpenAI request to a response: prompts -> token ids, checks against the
context, one generation per choice, then a JSON body or an SSE stream."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from afd import metrics
from afd.control import SamplingParams
from afd.errors import RequestError
from afd.tokenizer import ModelTokenizer
from services.gateway.answers import Reader, answer_readers, guide_marker, read_delta, read_whole
from services.gateway.balancer import Balancer
from services.gateway.detok import TokenBytes
from services.gateway.errors import APIError, invalid, validation_message
from services.gateway.generation import ChoiceRun, ChoiceSpec, ChoiceStreams, Delta
from services.gateway.latency import SLA, ChoiceTiming
from services.gateway.lifecycle import Lifecycle
from services.gateway.prompts import bad_word_ids, check_token_ids
from services.gateway.responses import (
    SSE_DONE,
    ChatFormatter,
    CompletionFormatter,
    sse,
    usage,
)
from services.gateway.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from services.gateway.tool_parsers import keeps_special_tokens

_INT64 = 2**63


@dataclass(frozen=True)
class GatewayState:
    """What every handler needs; built once at start-up."""

    tokenizer: ModelTokenizer
    token_bytes: TokenBytes
    balancer: Balancer
    model_name: str
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
    if name is not None and name != state.model_name:
        raise invalid(
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _seed(seed: int | None, j: int) -> int | None:
    # Choice j gets seed + j: choices differ, and the same request reproduces all of them.
    if seed is None:
        return None
    return (seed + j + _INT64) % (2 * _INT64) - _INT64


async def plan(
    state: GatewayState,
    req: ChatCompletionRequest | CompletionRequest,
    prompts: list[tuple[list[int], str]],
    request_id: str,
) -> list[ChoiceSpec]:
    """One ChoiceSpec per (prompt, choice), checked against the context length."""
    if len(prompts) * req.n > MAX_CHOICES:
        raise invalid(
            f"{len(prompts)} prompts x n={req.n} asks for {len(prompts) * req.n} choices; "
            f"at most {MAX_CHOICES} per request",
            "n",
        )
    limit = state.max_tokens_limit
    if limit and req.max_new_tokens and req.max_new_tokens > limit:
        raise invalid(
            f"max_tokens is {req.max_new_tokens}; this server allows at most {limit}",
            "max_tokens",
        )
    bias = req.token_bias
    guide_kind, guide = req.guide
    # a harmony answer's structure is special tokens: its reader needs them in the text (a
    # tool_choice guide leaves the model no harmony; another guide holds in the final body)
    chat = isinstance(req, ChatCompletionRequest)
    calls_guide = chat and req.tool_mode in ("required", "named")
    harmony = chat and state.chat_format == "harmony" and not calls_guide
    # a tool-call format written in special tokens is read from a text that keeps them
    tags = chat and req.tool_mode == "auto" and keeps_special_tokens(state.tool_parser)
    text_model = state.chat_format != "harmony"
    waits = chat and guide_kind and (harmony or (text_model and bool(state.reasoning_parser)))
    check_token_ids(state, [t for t, _ in bias], "logit_bias")
    check_token_ids(state, req.stop_token_ids or [], "stop_token_ids")
    check_token_ids(state, req.allowed_token_ids or [], "allowed_token_ids")
    bad_words = bad_word_ids(state, req.bad_words)
    await state.balancer.wait_started(state.startup_wait_s)
    max_len = await state.balancer.max_model_len()
    param = "messages" if chat else "prompt"
    nonce = secrets.token_hex(3)  # attention-side ids stay unique if a client reuses its id
    specs = []
    keep = req.truncate_prompt_tokens
    if keep == 0:
        raise invalid(
            "truncate_prompt_tokens must be -1 (the context) or >= 1", "truncate_prompt_tokens"
        )
    for p, (ids, echo) in enumerate(prompts):
        if not ids:
            raise invalid("the prompt is empty", param)
        if keep is not None:  # vLLM's: the prompt's last tokens
            ids = ids[-(max_len if keep == -1 else keep) :]
        if len(ids) >= max_len:
            raise invalid(
                f"the prompt has {len(ids)} tokens; this model's context is {max_len} tokens",
                param,
                "context_length_exceeded",
            )
        room = max_len - len(ids)
        max_tokens = req.max_new_tokens
        if max_tokens is None:
            max_tokens = min(room, limit) if limit else room
        if max_tokens > room:
            raise invalid(
                f"max_tokens is {max_tokens}, but the prompt ({len(ids)} tokens) leaves room for "
                f"only {room} of this model's {max_len}-token context",
                "max_tokens",
                "context_length_exceeded",
            )
        if req.min_tokens > max_tokens:
            raise invalid(
                f"min_tokens is {req.min_tokens}, more than max_tokens ({max_tokens})",
                "min_tokens",
            )
        after = (
            guide_marker(state.tokenizer, ids, state.chat_format, state.reasoning_parser)
            if waits
            else ()
        )
        for c in range(req.n):
            j = p * req.n + c
            params = _sampling(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=max(req.top_k, 0),
                seed=_seed(req.seed, j),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=req.num_logprobs,
                prompt_logprobs=_prompt_logprobs(req),
                cache_salt=req.cache_salt or "",
                logit_bias=bias,
                repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty,
                min_p=req.min_p,
                min_tokens=req.min_tokens,
                guide_kind=guide_kind,
                guide=guide,
                guide_after=after,
                bad_words=bad_words,
                allowed_token_ids=tuple(req.allowed_token_ids or ()),
            )
            spec = ChoiceSpec(
                j, f"{request_id}.{nonce}.{j}", ids, params, req.stop_strings, echo,
                echo_logprobs=_echo_logprobs(req),
                keep_special_tokens=harmony or not req.skip_special_tokens or tags,
                include_stop=req.include_stop_str_in_output,
            )  # fmt: skip
            specs.append(spec)
    return specs


def _sampling(**fields) -> SamplingParams:
    """The control plane's parameters; a value the schema let through but they refuse (a
    combination, say) is still the client's 400."""
    try:
        return SamplingParams(**fields)
    except RequestError as e:
        raise invalid(str(e)) from None


def _prompt_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    return req.num_prompt_logprobs if isinstance(req, CompletionRequest) else req.prompt_logprobs


def _echo_logprobs(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return isinstance(req, CompletionRequest) and req.echo_logprobs


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
    fmt = fmt_cls(
        f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        state.model_name,
        state.token_bytes,
        req.include_usage,
    )
    fmt.ids_as_tokens = req.return_tokens_as_token_ids
    streams = start_choices(state, request, specs, req.n)
    if req.continuous_usage:
        s = streams
        fmt.usage_so_far = lambda: usage(s.prompt_tokens, s.completion_tokens, s.cached_tokens)
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
                streams, fmt, first, with_lp, chat, req.include_usage, readers, echo
            ),
        )
    choices, prompt_lps, reasons = await _collect(streams, len(specs))
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
    state: GatewayState, request: Request, specs: list[ChoiceSpec], n: int
) -> ChoiceStreams:
    """Every choice running, their deltas on one stream that ends if the client leaves."""
    t_arrival = getattr(request.state, "t_arrival", None) or time.perf_counter()
    runs = [
        ChoiceRun(s, state.balancer, state.tokenizer, ChoiceTiming(t_arrival, state.sla))
        for s in specs
    ]
    streams = ChoiceStreams(runs, n)
    streams.start(lambda: _disconnected(request))
    return streams


async def _collect(
    streams: ChoiceStreams, n: int
) -> tuple[list[tuple[str, list, str]], list[list], list[int | str | None]]:
    """Each choice's (text, logprobs, finish reason), its prompt logprobs and stop reason."""
    texts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    prompt_lps: list[list] = [[] for _ in range(n)]
    finish = [""] * n
    reasons: list[int | str | None] = [None] * n
    try:
        while (d := await streams.next()) is not None:
            texts[d.index].append(d.text)
            lps[d.index] += d.logprobs
            prompt_lps[d.index] += d.prompt_logprobs
            finish[d.index] = d.finish_reason or finish[d.index]
            reasons[d.index] = d.stop_reason if d.finish_reason else reasons[d.index]
    finally:
        await streams.close()
    return [("".join(texts[i]), lps[i], finish[i]) for i in range(n)], prompt_lps, reasons


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
) -> AsyncIterator[bytes]:
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
                yield sse(fmt.chunk(d, with_lp, piece.calls, piece.reasoning))
            else:
                yield sse(fmt.chunk(d, with_lp))
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
    metrics.PROMPT_TOKENS.inc(streams.prompt_tokens)
    metrics.GENERATION_TOKENS.inc(streams.completion_tokens)
    for r in streams.runs:
        if r.finish_reason:
            metrics.REQUEST_SUCCESS.labels(finished_reason=r.finish_reason).inc()
