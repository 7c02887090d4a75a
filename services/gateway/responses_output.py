"""A Responses API answer (responses_api.py runs it): the Response object and its output items
(reasoning, a message, function calls), built whole or as the API's typed stream events
(`response.created` ... `response.completed`, each with its sequence number).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from afd.control import Logprob
from afd.sampling import SamplingParams
from services.gateway import handlers as h
from services.gateway.answers import read_delta
from services.gateway.errors import APIError
from services.gateway.generation import ChoiceStreams, Delta, Piece
from services.gateway.responses import ChatFormatter, sse
from services.gateway.responses_schema import ResponsesRequest


class Output:
    """One response's output items, built whole or event by event."""

    def __init__(
        self,
        req: ResponsesRequest,
        model: str,
        params: SamplingParams,
        logprobs: ChatFormatter | None = None,  # writes the tokens' logprobs, when asked
    ):
        self.req, self.model = req, model
        self._lp = logprobs
        self._pending: list[Logprob] = []  # logprobs not yet sent with a text delta
        self.params = params  # what ran (the model's defaults filled in)
        self.id = response_id()
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items so far (the open one included)
        self.reasoning = ""  # all of it, for the usage's reasoning tokens
        self._open: str = ""  # the type of the item still being written ("" none)
        self._seq = 0
        self.stored = False  # kept in the response store

    def response(
        self,
        finish: str | None,
        usage: dict | None = None,
        status: str = "",  # other than the finish tells: queued, failed, cancelled
        error: APIError | None = None,  # why it failed
    ) -> dict[str, Any]:
        """The Response object: in progress (finish None), completed or incomplete (the
        output cut at max_output_tokens), or the `status` given."""
        if not status:
            status = "in_progress" if finish is None else "completed"
            status = "incomplete" if finish == "length" else status
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        choice: Any = req.tool_choice or ("auto" if req.tools else "none")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "error": _error(error) if error is not None else None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "output": self.items if finish is not None or status in ("failed", "cancelled") else [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": _dump(fmt) if fmt else {"type": "text"}},
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "truncation": req.truncation,
            "store": self.stored,
            "background": req.background,
            "usage": usage,
        }

    def add_whole(self, piece: Piece, logprobs: list[Logprob] = ()) -> None:
        if piece.reasoning:
            self.reasoning = piece.reasoning
            self.items.append(_reasoning(piece.reasoning, "completed"))
        if piece.content or not piece.calls:
            self.items.append(_message(piece.content, "completed"))
            self.items[-1]["content"][0]["logprobs"] = self._entries(list(logprobs))
        for call in piece.calls:
            fn = call["function"]
            self.items.append(_call(call.get("id") or "", fn["name"], fn["arguments"], "completed"))

    # the stream

    def event(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        return sse({"type": kind, "sequence_number": self._seq - 1, **fields}, kind)

    def begin(self) -> list[bytes]:
        r = self.response(None)
        return [
            self.event("response.created", response=r),
            self.event("response.in_progress", response=r),
        ]

    def _entries(self, lps: list[Logprob]) -> list[dict[str, Any]]:
        return self._lp.logprobs(lps)["content"] if self._lp is not None and lps else []

    def feed(self, piece: Piece, logprobs: list[Logprob] = ()) -> list[bytes]:
        """The events of one delta's reasoning, content and calls; its tokens' logprobs go
        with the next text delta (all of the answer's, as a whole response has them)."""
        self._pending += logprobs
        out: list[bytes] = []
        if piece.reasoning:
            self.reasoning += piece.reasoning
            out += self._open_item("reasoning")
            out.append(self._delta("response.reasoning_text.delta", piece.reasoning))
        if piece.content:
            out += self._open_item("message")
            lps, self._pending = self._entries(self._pending), []
            self.items[-1]["content"][0]["logprobs"] += lps
            out.append(self._delta("response.output_text.delta", piece.content, logprobs=lps))
        for call in piece.calls:
            fn = call.get("function", {})
            if "name" in fn:  # a call's first delta opens its item
                out += self.close()
                item = _call(call.get("id") or "", fn["name"], "", "in_progress")
                out += self._add(item, "function_call")
            if fn.get("arguments"):
                item = self.items[-1]
                item["arguments"] += fn["arguments"]
                at = {"item_id": item["id"], "output_index": len(self.items) - 1}
                delta = fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", **at, delta=delta))
        return out

    def close(self) -> list[bytes]:
        """The open item's closing events, if one is open."""
        if not self._open:
            return []
        item, index = self.items[-1], len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        at = {**where, "content_index": 0}
        out = []
        if self._open == "message":
            part = item["content"][0]
            # the tokens after the last text delta (a stop token's): in the done event and the
            # final response, as a whole response has them
            part["logprobs"] += self._entries(self._pending)
            self._pending = []
            text = part["text"]
            lps = part["logprobs"]
            out.append(self.event("response.output_text.done", **at, text=text, logprobs=lps))
            out.append(self.event("response.content_part.done", **at, part=part))
        elif self._open == "reasoning":
            part = item["content"][0]
            out.append(self.event("response.reasoning_text.done", **at, text=part["text"]))
            out.append(self.event("response.content_part.done", **at, part=part))
        else:
            args = item["arguments"]
            out.append(self.event("response.function_call_arguments.done", **where, arguments=args))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self._open = ""
        return out

    def _open_item(self, kind: str) -> list[bytes]:
        if self._open == kind:
            return []
        out = self.close()
        item = _message("", "in_progress") if kind == "message" else _reasoning("", "in_progress")
        out += self._add(item, kind)
        at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        out.append(self.event("response.content_part.added", **at, part=dict(item["content"][0])))
        return out

    def _add(self, item: dict[str, Any], kind: str) -> list[bytes]:
        self.items.append(item)
        self._open = kind
        # as added: no content parts yet (content_part.added brings each)
        snapshot = {**item, "content": []} if "content" in item else dict(item)
        index = len(self.items) - 1
        return [self.event("response.output_item.added", output_index=index, item=snapshot)]

    def _delta(self, kind: str, text: str, **extra: Any) -> bytes:
        item = self.items[-1]
        item["content"][0]["text"] += text
        return self.event(kind, item_id=item["id"], output_index=len(self.items) - 1,
                          content_index=0, delta=text, **extra)  # fmt: skip


async def events(
    streams: ChoiceStreams,
    out: Output,
    first: Delta | None,
    readers,
    tokenizer,
    done: Callable[[dict[str, Any]], None],  # gets the final Response object, however it ends
    begun: bool = False,  # the opening events went out already
) -> AsyncIterator[bytes]:
    finish: str | None = None
    final = out.response(None, status="cancelled")  # unless it ends otherwise
    try:
        for e in [] if begun else out.begin():
            yield e
        d = first
        while d is not None:
            if readers is not None:
                d, piece = read_delta(readers[0], d)
                piece = Piece(piece.reasoning, d.text, piece.calls)
            else:
                piece = Piece(content=d.text)
            for e in out.feed(piece, d.logprobs):
                yield e
            finish = d.finish_reason or finish
            d = await streams.next()
        if streams.disconnected:
            return
        h.count_finished(streams)
        for e in out.close():
            yield e
        final = out.response(finish or "stop", usage(streams, out.reasoning, tokenizer))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield out.event(kind, response=final)
    except APIError as e:  # the status line is gone: the error travels as an event
        final = out.response(None, status="failed", error=e)
        yield out.event("error", code=e.code, message=e.message, param=e.param)
    finally:
        done(final)
        await streams.close()


def _dump(fmt: Any) -> dict[str, Any]:
    return fmt.model_dump(by_alias=True, exclude_none=True)


def _error(e: APIError) -> dict[str, Any]:
    """A failed response's error, in the codes OpenAI's Response allows."""
    code = "rate_limit_exceeded" if e.status == 429 else "server_error"
    return {"code": "invalid_prompt" if e.status < 500 and e.status != 429 else code,
            "message": e.message}  # fmt: skip


def usage(streams: ChoiceStreams, reasoning: str, tokenizer) -> dict[str, Any]:
    """OpenAI's usage; the reasoning tokens as the tokenizer counts the reasoning's text."""
    return {
        "input_tokens": streams.prompt_tokens,
        "input_tokens_details": {"cached_tokens": streams.cached_tokens},
        "output_tokens": streams.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": len(tokenizer.encode(reasoning)) if reasoning else 0
        },
        "total_tokens": streams.prompt_tokens + streams.completion_tokens,
    }


def _message(text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
            "content": [part]}  # fmt: skip


def _reasoning(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def response_id() -> str:
    """A new response's id: random, as OpenAI's are (never the client's X-Request-Id: a stored
    response is read by its id, which must be neither guessable nor shared)."""
    return _id("resp")


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"
