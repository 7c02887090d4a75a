"""Tool calls in a chat answer: the guide that a forced `tool_choice` puts on the output, and
the calls read out of each choice's text as it streams, as OpenAI's `tool_calls` deltas.

What each `tool_choice` does (vLLM's semantics, so a client written for it works here):
- "none": the tools are shown to the model; its text is content, never parsed.
- "auto": the model may call; the server's `--tool-call-parser` reads calls out of its text
  (it needs `--enable-auto-tool-choice`, as vLLM does).
- "required": the output is guided to a JSON array of {"name", "arguments"} objects, one of the
  tools' names and its parameters' schema each (at most one item without parallel calls).
- a named function: the output is guided to that function's parameters; it is the arguments.
Calls get ids of the form call_<24 hex digits>; a choice that called ends with "tool_calls"
(OpenAI keeps "stop" for a named function, and so does this).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from services.gateway.tool_parsers import PARSERS, ParsedCall

_ANY_OBJECT = {"type": "object"}


def guide_schema(tools: list[dict[str, Any]], name: str, parallel: bool) -> dict | None:
    """The JSON schema the output must fit for a named function (`name`) or for "required"
    (`name` empty); None when `name` is not one of `tools`."""
    params = {t["function"]["name"]: t["function"].get("parameters") or _ANY_OBJECT for t in tools}
    if name:
        return params.get(name)
    items = [
        {
            "type": "object",
            "properties": {"name": {"enum": [n]}, "arguments": p},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n, p in params.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _whole(index: int, call: ParsedCall, call_id: str = "") -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class CallStream:
    """One choice's text -> (content, tool-call deltas), piece by piece; `final` marks the
    last piece. The deltas are OpenAI's stream shape; `merge` makes a message's calls."""

    def __init__(
        self,
        mode: str,
        parser: str = "",
        name: str = "",
        parallel: bool = True,
        tools: list[dict[str, Any]] | None = None,  # the request's, as the template takes them
    ):
        self.mode = mode  # auto, required or named
        self.name = name  # the named function
        self.parallel = parallel
        self.calls = 0  # calls started so far
        self._parser = PARSERS[parser]() if mode == "auto" else None
        if self._parser is not None and tools:
            self._parser.schemas = {
                t["function"]["name"]: t["function"].get("parameters") or {} for t in tools
            }
        self._text: list[str] = []  # "required": the whole output, read at the end

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.mode == "named":
            return "", self._named(text, final)
        if self.mode == "required":
            self._text.append(text)
            return self._required() if final else ("", [])
        assert self._parser is not None
        content, calls = self._parser.feed(text)
        if final:
            more, last = self._parser.finish()
            content, calls = content + more, calls + last
        if not self.parallel:  # only the first call counts
            calls = calls[: max(0, 1 - self.calls)]
        deltas = [_whole(self.calls + i, c, self._parser.new_id()) for i, c in enumerate(calls)]
        self.calls += len(deltas)
        return content, deltas

    def _named(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self.calls:
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        if not text and not final:
            return []
        self.calls = 1
        fn = {"name": self.name, "arguments": text}
        return [{"index": 0, "id": new_call_id(), "type": "function", "function": fn}]

    def _required(self) -> tuple[str, list[dict[str, Any]]]:
        text = "".join(self._text)
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            items = None
        if not isinstance(items, list):
            return text, []  # cut off (max_tokens): the text as it is
        calls = [
            ParsedCall(it["name"], json.dumps(it.get("arguments", {}), ensure_ascii=False))
            for it in items
            if isinstance(it, dict) and isinstance(it.get("name"), str)
        ]
        self.calls = len(calls)
        return "", [_whole(i, c) for i, c in enumerate(calls)]

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason once it has called: "tool_calls" where it stopped."""
        if self.calls and reason == "stop" and self.mode != "named":
            return "tool_calls"
        return reason


def merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's `tool_calls` from its stream deltas (arguments concatenated per call)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(
            d["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        call["id"] = d.get("id", call["id"])
        call["function"]["name"] = d["function"].get("name", call["function"]["name"])
        call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]
