"""Tool-call parsers: a model's text -> its content and the calls it wrote, as it streams.

One registry (`PARSERS`), named as vLLM's `--tool-call-parser` names them, so a command line
written for vLLM selects the same format here. A parser is fed the choice's text in pieces
(after stop strings) and returns at each piece the content that is certainly not part of a
call, and every call it has seen whole; it holds back only text that may still become a call.
Fed a whole text at once or a character at a time, it returns the same content and calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCallParser:
    """Base of every format: `feed` pieces of text, then `finish` once."""

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError


class TaggedJsonParser(ToolCallParser):
    """Calls written as OPEN + {"name": ..., "arguments": {...}} + CLOSE among the content.
    Whitespace between content and a call, or between calls, belongs to neither. A call that
    is not such an object stays in the content, as the model wrote it."""

    open_tag = ""
    close_tag = ""

    def __init__(self) -> None:
        self._buf = ""  # text not yet decided
        self._inside = False  # in a call: _buf is its body so far
        self._after_call = False  # whitespace that follows a call is dropped
        self._gap = ""  # the whitespace before the call being read

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self._inside:
                end = self._buf.find(self.close_tag)
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(self.close_tag) :]
                self._inside = False
                self._take(body, content, calls, closed=True)
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._after_call = False
            start = self._buf.find(self.open_tag)
            if start >= 0:
                # whitespace just before a call is the call's, not the content's (unless the
                # call turns out not to be one)
                before = self._buf[:start].rstrip()
                content.append(before)
                self._gap = self._buf[len(before) : start]
                self._buf = self._buf[start + len(self.open_tag) :]
                self._inside = True
                continue
            # hold back what may still begin a call, and the whitespace before it (which is
            # the call's if one follows)
            keep = held_back(self._buf, self.open_tag)
            sure = self._buf[: len(self._buf) - keep].rstrip()
            content.append(sure)
            self._buf = self._buf[len(sure) :]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        content: list[str] = []
        calls: list[ParsedCall] = []
        if self._inside:  # cut off before its close tag (max_tokens, a stop string)
            self._take(self._buf, content, calls, closed=False)
        elif not self._after_call:
            content.append(self._buf)
        self._buf, self._inside = "", False
        return "".join(content), calls

    def _take(self, body: str, content: list[str], calls: list[ParsedCall], closed: bool) -> None:
        call = _call(body)
        if call is None:
            content.append(self._gap + self.open_tag + body + (self.close_tag if closed else ""))
        else:
            calls.append(call)
            self._after_call = True


class HermesParser(TaggedJsonParser):
    """Hermes, Qwen 2.5 and Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (it may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call(body: str) -> ParsedCall | None:
    try:
        obj: Any = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments' JSON as a string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}
