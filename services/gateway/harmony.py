"""gpt-oss's harmony answers -> reasoning, content and tool calls, as they stream.

A harmony answer is a run of messages, each a header, `<|message|>`, a body, and an end:
`<|end|>` (another message follows, after `<|start|>`), `<|return|>` (done) or `<|call|>` (a
tool call, done). The prompt ends with `<|start|>assistant`, so the first header is already
open. A header names the message's channel (`<|channel|>analysis`) and, for a tool call, its
recipient (`to=functions.get_weather`, in the role part or the channel part). Bodies go:
- on the analysis channel: to `reasoning_content` (the chain of thought);
- to a recipient `functions.NAME`, where the request reads calls (tool_choice "auto" with
  `--enable-auto-tool-choice`): a tool call whose arguments are the body; other recipients
  (built-in tools, or calls not read) are the model's own actions: reasoning too;
- on the final and commentary channels (the answer, and preambles to calls): content.
Text before any `<|message|>` that never becomes a header (a model that does not speak
harmony) is content. The gateway keeps special tokens in a harmony choice's text for this.
"""

from __future__ import annotations

import re

from services.gateway.generation import Piece
from services.gateway.reasoning import PARSERS as REASONING_PARSERS
from services.gateway.tool_calls import new_call_id
from services.gateway.tool_parsers import PARSERS as TOOL_PARSERS
from services.gateway.tool_parsers import held_back

# vLLM's names for reading harmony: flags written for vLLM select it here too
HARMONY_TOOLS = "openai"
HARMONY_REASONING = "openai_gptoss"
TOOL_PARSER_NAMES = (*TOOL_PARSERS, HARMONY_TOOLS)
REASONING_PARSER_NAMES = (*REASONING_PARSERS, HARMONY_REASONING)

MESSAGE = "<|message|>"
# where a guided answer's guide starts to hold: the final channel's body (the analysis before
# it is free), as vLLM guides gpt-oss
FINAL_BODY = "<|channel|>final<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


class HarmonyReader:
    """One choice's harmony text -> Piece, piece by piece; the same split whole or streamed."""

    def __init__(self, read_calls: bool) -> None:
        self.read_calls = read_calls
        self.calls = 0
        self._buf = ""
        self._header = ""  # the open header so far
        self._route = ""  # "" (in a header), reasoning, content or call
        self._name = ""  # the call's function
        self._args: list[str] = []  # the call's body so far
        self._spoke = False  # a header has closed: the model speaks harmony

    def feed(self, text: str, final: bool) -> Piece:
        self._buf += text
        out = Piece()
        while self._buf:
            if not self._route:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    keep = held_back(self._buf, MESSAGE)
                    self._header += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._open(self._header + self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE) :]
                continue
            ends = [(i, e) for e in ENDS if (i := self._buf.find(e)) >= 0]
            if ends:
                at, end = min(ends)
                self._emit(self._buf[:at], out)
                self._buf = self._buf[at + len(end) :]
                self._close(out)
                continue
            keep = max(held_back(self._buf, e) for e in ENDS)
            self._emit(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            break
        if final:
            self._finish(out)
        return out

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _open(self, header: str) -> None:
        self._header, self._spoke = "", True
        channel = m.group(1) if (m := _CHANNEL.search(header)) else ""
        recipient = m.group(1) if (m := _RECIPIENT.search(header)) else ""
        if recipient.startswith(_FUNCTIONS) and self.read_calls:
            self._route, self._name, self._args = "call", recipient[len(_FUNCTIONS) :], []
        elif channel == "analysis" or recipient:
            self._route = "reasoning"
        else:
            self._route = "content"

    def _emit(self, body: str, out: Piece) -> None:
        if self._route == "call":
            self._args.append(body)
        elif self._route == "reasoning":
            out.reasoning += body
        else:
            out.content += body

    def _close(self, out: Piece) -> None:
        if self._route == "call":
            fn = {"name": self._name, "arguments": "".join(self._args).strip()}
            out.calls.append(
                {"index": self.calls, "id": new_call_id(), "type": "function", "function": fn}
            )
            self.calls += 1
        self._route = ""

    def _finish(self, out: Piece) -> None:
        """The answer ended: what was held back, and a body cut off (max_tokens) as it is."""
        if self._route:
            self._emit(self._buf, out)
            self._close(out)
        elif not self._spoke:
            out.content += self._header + self._buf  # no harmony at all: plain text
        self._buf = self._header = ""
