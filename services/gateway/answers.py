"""A chat choice's text -> its reasoning, content and tool calls, piece by piece.

The reasoning parser (`--reasoning-parser`) splits the thinking off first; the tool-call reader
(tool_calls.py) reads calls out of what is left. A guided output (a named function, "required",
or structured outputs) is never split into reasoning: the guide leaves the model no room to
think, so its whole text is the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.gateway.reasoning import PARSERS as REASONING_PARSERS
from services.gateway.reasoning import ThinkParser
from services.gateway.tool_calls import CallStream


@dataclass
class Piece:
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool_calls deltas


class AnswerReader:
    def __init__(self, reasoning_parser: str = "", calls: CallStream | None = None) -> None:
        self._think: ThinkParser | None = (
            REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        )
        self._calls = calls

    def feed(self, text: str, final: bool) -> Piece:
        reasoning = ""
        if self._think is not None:
            reasoning, text = self._think.feed(text)
            if final:
                r, t = self._think.finish()
                reasoning, text = reasoning + r, text + t
        if self._calls is None:
            return Piece(reasoning, text)
        content, deltas = self._calls.feed(text, final)
        return Piece(reasoning, content, deltas)

    def finish_reason(self, reason: str) -> str:
        return self._calls.finish_reason(reason) if self._calls is not None else reason
