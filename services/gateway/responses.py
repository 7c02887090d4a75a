"""OpenAI response bodies (chat.completion, text_completion and their stream chunks), built as
plain dicts: a stream writes one per token, and pydantic per chunk would cost more than the
rest of the gateway together."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from afd.control import Logprob
from services.gateway.detok import TokenBytes
from services.gateway.generation import Delta, Piece


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # as OpenAI reports prompt caching: the prompt tokens that were not computed again
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(obj: Any, event: str = "") -> bytes:
    """One server-sent event carrying `obj` as JSON (named `event`, as the Responses API
    names its events)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class _Formatter:
    """What every body of one response shares: id, creation time, model, token texts."""

    object_name = ""
    chunk_name = ""

    def __init__(self, response_id: str, model: str, token_bytes: TokenBytes, usage_chunks: bool):
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.tb = token_bytes
        self.usage_chunks = usage_chunks  # include_usage: every chunk has "usage" (null)
        self.ids_as_tokens = False  # vLLM's return_tokens_as_token_ids: "token_id:N"
        # vLLM's continuous_usage_stats: the usage so far, for every chunk's "usage"
        self.usage_so_far: Callable[[], dict[str, Any]] | None = None

    def name(self, token: int) -> str:
        """A token as logprobs name it: its text, or "token_id:N"."""
        return f"token_id:{token}" if self.ids_as_tokens else self.tb.text(token)

    def _envelope(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if name == self.chunk_name and self.usage_chunks:
            body["usage"] = self.usage_so_far() if self.usage_so_far else None
        return body

    def prompt_logprobs(self, lps: list[Logprob]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs` of one prompt: null for its first token, then per token
        {token id: {logprob, decoded_token}} for it and its top alternatives."""
        entries: list[dict[str, Any] | None] = [None]
        for token, lp, top in lps:
            entry = {str(t): self._scored(t, v) for t, v in top}
            entry[str(token)] = self._scored(token, lp)
            entries.append(entry)
        return entries

    def _scored(self, token: int, lp: float) -> dict[str, Any]:
        return {"logprob": lp, "decoded_token": self.tb.text(token)}

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        return {
            **self._envelope(self.chunk_name, []),
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }


class ChatFormatter(_Formatter):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def logprobs(self, entries: list[Logprob]) -> dict[str, Any]:
        return {"content": [self._entry(t, lp, top) for t, lp, top in entries]}

    def _entry(self, token: int, lp: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        return {
            **self._token(token, lp),
            "top_logprobs": [self._token(t, v) for t, v in top],
        }

    def _token(self, token: int, lp: float) -> dict[str, Any]:
        raw = self.name(token).encode() if self.ids_as_tokens else self.tb(token)
        return {"token": self.name(token), "logprob": lp, "bytes": list(raw)}

    def role_chunk(self, index: int) -> dict[str, Any]:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}}
        return self._envelope(
            self.chunk_name, [{**choice, "logprobs": None, "finish_reason": None}]
        )

    def chunk(
        self,
        d: Delta,
        with_logprobs: bool,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str = "",
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        if d.text:
            delta["content"] = d.text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {
            "index": d.index,
            "delta": delta,
            "logprobs": self.logprobs(d.logprobs) if with_logprobs and d.logprobs else None,
            "finish_reason": d.finish_reason,
        }
        if d.finish_reason:
            choice["stop_reason"] = d.stop_reason  # vLLM's, in the last chunk
        return self._envelope(self.chunk_name, [choice])

    def response(
        self,
        choices: list[tuple[str, list[Logprob], str]],
        with_logprobs: bool,
        use: dict,
        answers: list[Piece] | None = None,
    ) -> dict[str, Any]:
        """`choices`: (text, logprobs, finish_reason) in index order; `answers`: each choice's
        reasoning and tool calls, where a reader split them off (a message that called and
        wrote nothing else has null content)."""
        body = self._envelope(
            self.object_name,
            [
                {
                    "index": i,
                    "message": self._message(text, answers[i] if answers else None),
                    "logprobs": self.logprobs(lps) if with_logprobs else None,
                    "finish_reason": finish,
                }
                for i, (text, lps, finish) in enumerate(choices)
            ],
        )
        return {**body, "usage": use, "system_fingerprint": None}

    @staticmethod
    def _message(text: str, answer: Piece | None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if answer is not None and answer.reasoning:
            msg["reasoning_content"] = answer.reasoning
        if answer is not None and answer.calls:
            msg["content"] = text or None
            msg["tool_calls"] = answer.calls
        return msg


class CompletionFormatter(_Formatter):
    object_name = "text_completion"
    chunk_name = "text_completion"

    def add_prompt_logprobs(self, body: dict[str, Any], per_choice: list[list[Logprob]]) -> None:
        """vLLM's `prompt_logprobs` in each choice."""
        for choice, lps in zip(body["choices"], per_choice, strict=True):
            choice["prompt_logprobs"] = self.prompt_logprobs(lps)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}  # per choice: text length so far (text_offset)

    def logprobs(self, index: int, entries: list[Logprob]) -> dict[str, Any]:
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        offset = self._offsets.get(index, 0)
        for token, lp, top in entries:
            text = self.tb.text(token)
            out["tokens"].append(self.name(token))
            out["token_logprobs"].append(lp)
            # an echoed prompt's first token has neither (None), as OpenAI answers
            out["top_logprobs"].append(None if top is None else {self.name(t): v for t, v in top})
            out["text_offset"].append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return out

    def chunk(self, d: Delta, with_logprobs: bool) -> dict[str, Any]:
        choice = {
            "index": d.index,
            "text": d.text,
            "logprobs": self.logprobs(d.index, d.logprobs) if with_logprobs else None,
            "finish_reason": d.finish_reason,
        }
        if d.finish_reason:
            choice["stop_reason"] = d.stop_reason  # vLLM's, in the last chunk
        return self._envelope(self.chunk_name, [choice])

    def response(
        self, choices: list[tuple[str, list[Logprob], str]], with_logprobs: bool, use: dict
    ) -> dict[str, Any]:
        body = self._envelope(
            self.object_name,
            [
                {
                    "index": i,
                    "text": text,
                    "logprobs": self.logprobs(i, lps) if with_logprobs else None,
                    "finish_reason": finish,
                }
                for i, (text, lps, finish) in enumerate(choices)
            ],
        )
        return {**body, "usage": use, "system_fingerprint": None}
