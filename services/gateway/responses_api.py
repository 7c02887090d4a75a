"""OpenAI's Responses API routes: `POST /v1/responses` runs the request as the chat it
translates to (responses_schema.py), through the same prompts, guides and answer readers, and
answers whole, as a stream of events (responses_output.py), or at once as a queued background
response; a stored response (response_store.py) is read, listed, cancelled and deleted by id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway import choices, prompts, responses_truncation
from services.gateway import handlers as h
from services.gateway.answers import answer_readers, read_whole
from services.gateway.errors import APIError, invalid
from services.gateway.generation import ChoiceStreams, Piece
from services.gateway.response_store import ResponseStore, Stored
from services.gateway.responses import ChatFormatter
from services.gateway.responses_output import Output, events, usage
from services.gateway.responses_schema import ResponsesRequest

log = logging.getLogger("afd.gateway")

MAX_LIST = 100  # input items per page, at most (OpenAI's bound)


def add_routes(app: FastAPI, state: h.GatewayState):
    """The Responses API's routes; returns the create handler (for SageMaker's /invocations)."""

    @app.post("/v1/responses")
    async def create(request: Request):
        req = await h.parse(request, ResponsesRequest)
        return await respond(state, request, req)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str):
        entry = _stored(state, response_id)
        if request.query_params.get("stream", "false").lower() in ("false", "0"):
            return JSONResponse(entry.response)
        if entry.events is None:
            raise invalid(
                "only a background response created with stream: true can be streamed again",
                "stream",
            )
        after = request.query_params.get("starting_after", "-1")
        if not after.lstrip("-").isdigit():
            raise invalid("starting_after must be an event's sequence number", "starting_after")
        return _sse(entry.follow(int(after) + 1))

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        _stored(state, response_id)
        state.responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str):
        return JSONResponse(await _cancel(_stored(state, response_id)))

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str):
        return JSONResponse(_page(_stored(state, response_id).input, request.query_params))

    return create


async def respond(state: h.GatewayState, request: Request, req: ResponsesRequest) -> Response:
    h.check_model(state, req.model)
    store = state.responses
    if req.background and not store.enabled:
        raise invalid(
            "background responses need the response store, which this gateway runs without "
            "(--responses-store-mb 0)",
            "background",
        )
    history = []
    if req.previous_response_id is not None:
        history = _store(state).conversation(req.previous_response_id)
    role = "developer" if state.chat_format == "harmony" else "system"
    chat = req.to_chat(role, history)
    prompts.check_tools(state, chat)
    ids = await prompts.chat_prompt(state, chat)
    if req.truncation == "auto":
        chat, ids = await responses_truncation.fit(state, req, role, history, chat, ids)
    rid = request.state.request_id
    specs = await choices.plan(state, chat, [(ids, "")], rid)
    waits = bool(specs[0].params.guide_after)
    readers = answer_readers(
        chat, state.tool_parser, state.reasoning_parser, 1, state.chat_format, guide_waits=waits
    )
    fmt = ChatFormatter(rid, state.model_name, state.token_bytes, False)
    fmt.ids_as_tokens = state.tokens_as_token_ids
    out = Output(req, state.model_name, specs[0].params, fmt if req.wants_logprobs else None)
    entry = None
    if req.store and store.enabled:
        out.stored = True
        first = out.response(None, status="queued" if req.background else "")
        entry = Stored(first, req.input_items(), req.previous_response_id)
        store.put(entry)
    done = store.update if entry is not None else (lambda _r: None)
    if entry is not None and req.background:
        start = functools.partial(h.start_choices, state, request, specs, 1, watch_client=False)
        if req.stream:  # followed from its buffer: the client may leave and come back
            entry.events = []
            entry.run(asyncio.create_task(_background_stream(state, entry, start, out, readers)))
            return _sse(entry.follow(0))
        entry.run(asyncio.create_task(_background(state, start, out, readers)))
        return JSONResponse(entry.response)
    streams = h.start_choices(state, request, specs, 1)
    try:
        if req.stream:
            return await h.event_stream(
                streams, lambda first: events(streams, out, first, readers, state.tokenizer, done)
            )
        final = await _whole(state, streams, out, readers)
    except APIError as e:
        done(out.response(None, status="failed", error=e))
        raise
    except BaseException:
        done(out.response(None, status="cancelled"))
        raise
    if final is None:  # the client left
        done(out.response(None, status="cancelled"))
        return Response(status_code=499)
    done(final)
    return JSONResponse(final)


async def _whole(
    state: h.GatewayState, streams: ChoiceStreams, out: Output, readers
) -> dict[str, Any] | None:
    """The finished Response object; None if the client left first."""
    (answer,), _, _, _ = await h.collect(streams, 1)
    if streams.disconnected:
        return None
    h.count_finished(streams)
    content, lps, finish = answer
    piece = Piece(content=content)
    if readers is not None:
        _, (piece,) = read_whole([answer], readers)
    out.add_whole(piece, lps)
    return out.response(finish, usage(streams, out.reasoning, state.tokenizer))


async def _background(state: h.GatewayState, start, out: Output, readers) -> None:
    """A background response's generation: its stored object goes from queued to in
    progress to how it ended. Counted in flight, so a draining gateway waits for it."""
    store = state.responses
    final = out.response(None, status="cancelled")  # unless it ends otherwise
    state.lifecycle.inflight += 1
    try:
        store.update(out.response(None))
        final = await _whole(state, start(), out, readers) or final
    except APIError as e:
        final = out.response(None, status="failed", error=e)
    except Exception as e:  # noqa: BLE001 - whatever it was, the response says it failed
        log.exception("background response %s failed", out.id)
        final = out.response(None, status="failed", error=APIError(500, f"internal error: {e}"))
    finally:
        state.lifecycle.inflight -= 1
        store.update(final)


async def _background_stream(
    state: h.GatewayState, entry: Stored, start, out: Output, readers
) -> None:
    """A background stream's generation: its events into the entry's buffer, whoever
    follows them; the stored object ends as the stream does."""
    store = state.responses
    state.lifecycle.inflight += 1
    try:
        store.update(out.response(None))
        for event in out.begin():  # at once: the client learns the id to come back with
            entry.publish(event)
        streams = start()
        try:
            first = await streams.next()
        except APIError as e:
            await streams.close()
            store.update(out.response(None, status="failed", error=e))
            entry.publish(out.event("error", code=e.code, message=e.message, param=e.param))
            return
        tokenizer = state.tokenizer
        async for event in events(streams, out, first, readers, tokenizer, store.update, True):
            entry.publish(event)
    finally:
        state.lifecycle.inflight -= 1


def _sse(body) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def _cancel(entry: Stored) -> dict[str, Any]:
    if entry.task is None:
        raise invalid(
            "only a background response can be cancelled; this one was answered as it ran",
            "response_id",
        )
    if entry.running:
        entry.task.cancel()
        await asyncio.wait([entry.task])
        if entry.running:  # cancelled before it ever ran
            entry.response = {**entry.response, "status": "cancelled"}
    return entry.response


def _store(state: h.GatewayState) -> ResponseStore:
    if not state.responses.enabled:
        raise APIError(
            404,
            "this gateway stores no responses (--responses-store-mb 0)",
            "invalid_request_error",
            None,
            "not_found",
        )
    return state.responses


def _stored(state: h.GatewayState, response_id: str) -> Stored:
    return _store(state).get(response_id)


def _page(items: list[dict[str, Any]], query) -> dict[str, Any]:
    """One page of a stored response's input items, as OpenAI's cursor lists them."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be asc or desc", "order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST:
        raise invalid(f"limit must be an integer from 1 to {MAX_LIST}", "limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((k for k, i in enumerate(ordered) if i["id"] == after), None)
        if at is None:
            raise invalid(f"no input item {after!r} in this response", "after")
        ordered = ordered[at + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
