"""A chat choice's text -> its reasoning, content and tool calls, piece by piece.

The reasoning parser (`--reasoning-parser`) splits the thinking off first; the tool-call reader
(tool_calls.py) reads calls out of what is left. A guided output (a named function, "required",
or structured outputs) under a reasoning parser is free until the reasoning ends and guided
after it (handlers.py asks the attention server for that), so it is split as any other; where
the prompt already closed the thinking, the guide holds from the first token and the whole
text is the answer.
"""

from __future__ import annotations

from dataclasses import replace

from afd.tokenizer import ModelTokenizer
from services.gateway.generation import Delta, Piece
from services.gateway.harmony import FINAL_BODY, HarmonyReader
from services.gateway.reasoning import PARSERS as REASONING_PARSERS
from services.gateway.reasoning import ThinkParser, think_marker
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.tool_calls import CallStream, merge


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


Reader = AnswerReader | HarmonyReader  # what reads one chat choice's text


def guide_marker(
    tokenizer: ModelTokenizer, prompt_ids: list[int], chat_format: str, reasoning_parser: str
) -> tuple[int, ...]:
    """The tokens after which a guided chat answer's grammar holds (SamplingParams.guide_after):
    a harmony answer's final body, or the end of a thinking model's reasoning; () for a model
    that does neither, or a prompt that already closed the thinking."""
    if chat_format == "harmony":
        return tuple(tokenizer.encode(FINAL_BODY))
    if reasoning_parser:
        return think_marker(reasoning_parser, tokenizer, prompt_ids)
    return ()


def answer_readers(
    req: ChatCompletionRequest | CompletionRequest,
    tool_parser: str,
    reasoning_parser: str,
    n: int,
    chat_format: str = "text",
    guide_waits: bool = False,
) -> list[Reader] | None:
    """Each chat choice's reader of reasoning and tool calls; None when its text is the
    answer as it is. `guide_waits`: the choices' guides hold only after the reasoning."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    mode, name, parallel = req.tool_mode, req.called_tool, req.parallel_tool_calls
    if chat_format == "harmony" and (guide_waits or not req.guide[0]):
        return [HarmonyReader(mode == "auto" and bool(tool_parser)) for _ in range(n)]
    # a guide from the first token leaves no thinking
    think = reasoning_parser if guide_waits or not req.guide[0] else ""
    if req.tool_mode == "none" and not think:
        return None
    return [
        AnswerReader(
            think,
            None
            if mode == "none"
            else CallStream(mode, tool_parser, name, parallel, req.tool_dicts),
        )
        for _ in range(n)
    ]


def read_whole(
    choices: list[tuple[str, list, str]], readers: list[Reader]
) -> tuple[list[tuple[str, list, str]], list[Piece]]:
    """Whole answers -> (content, logprobs, finish reason) and each one's reasoning and tool
    calls (merged into a message's)."""
    out, answers = [], []
    for (text, lps, finish), reader in zip(choices, readers, strict=True):
        piece = reader.feed(text, final=True)
        out.append((piece.content, lps, reader.finish_reason(finish)))
        answers.append(Piece(piece.reasoning, piece.content, merge(piece.calls)))
    return out, answers


def read_delta(reader: Reader, d: Delta) -> tuple[Delta, Piece]:
    """A streamed delta -> its content, and its reasoning and tool-call deltas."""
    final = d.finish_reason is not None
    piece = reader.feed(d.text, final)
    finish = reader.finish_reason(d.finish_reason) if final else None
    return replace(d, text=piece.content, finish_reason=finish), piece
