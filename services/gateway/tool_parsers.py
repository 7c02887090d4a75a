"""Tool-call parsers: a model's text -> its content and the calls it wrote, as it streams.

One registry (`PARSERS`), named as vLLM's `--tool-call-parser` names them, so a command line
written for vLLM selects the same format here. A parser is fed the choice's text in pieces
(after stop strings) and returns at each piece the content that is certainly not part of a
call, and every call it has seen whole; it holds back only text that may still become a call.
Fed a whole text at once or a character at a time, it returns the same content and calls.
"""

from __future__ import annotations

import html
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCallParser:
    """Base of every format: `feed` pieces of text, then `finish` once."""

    # the format's tags are special tokens: the choice's text must keep them
    keeps_special_tokens = False
    # function name -> its parameters' JSON schema (the request's tools), for formats that
    # write arguments as text and type them by it
    schemas: dict[str, dict[str, Any]] = {}

    @staticmethod
    def new_id() -> str:
        """A new call's id, where the format's templates want their own kind; "" for the
        API's usual ids."""
        return ""

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
    # markers around a run of calls that mean nothing else: taken out of the text first
    wrapper_tags: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._wrappers = _Without(self.wrapper_tags)
        self._buf = ""  # text not yet decided
        self._inside = False  # in a call: _buf is its body so far
        self._after_call = False  # whitespace that follows a call is dropped
        self._gap = ""  # the whitespace before the call being read

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        return self._read(self._wrappers.feed(text))

    def _read(self, text: str) -> tuple[str, list[ParsedCall]]:
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
        content, calls = self._read(self._wrappers.finish())
        content, calls = [content], list(calls)
        if self._inside:  # cut off before its close tag (max_tokens, a stop string)
            self._take(self._buf, content, calls, closed=False)
        elif not self._after_call:
            content.append(self._buf)
        self._buf, self._inside = "", False
        return "".join(content), calls

    def _take(self, body: str, content: list[str], calls: list[ParsedCall], closed: bool) -> None:
        call = self.parse(body)
        if call is None:
            content.append(self._gap + self.open_tag + body + (self.close_tag if closed else ""))
        else:
            calls.append(call)
            self._after_call = True

    def parse(self, body: str) -> ParsedCall | None:
        """One call's body -> the call; None when it is not one (it stays content)."""
        return _call(body)


class HermesParser(TaggedJsonParser):
    """Hermes, Qwen 2.5 and Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"


class DeepSeekV3Parser(TaggedJsonParser):
    """DeepSeek-V3 (and R1-0528): a run of calls between <｜tool▁calls▁begin｜> and
    <｜tool▁calls▁end｜>, each <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME, then the arguments
    in a fenced json block, then <｜tool▁call▁end｜>. The tags are special tokens."""

    keeps_special_tokens = True
    open_tag = "<｜tool▁call▁begin｜>"
    close_tag = "<｜tool▁call▁end｜>"
    wrapper_tags = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    sep = "<｜tool▁sep｜>"

    def parse(self, body: str) -> ParsedCall | None:
        kind, sep, rest = body.partition(self.sep)
        name, _, args = rest.partition("\n")
        args = args.strip()
        if not sep or kind.strip() != "function" or not name.strip():
            return None
        if not (args.startswith("```json") and args.endswith("```")):
            return None
        return _arguments(name.strip(), args[len("```json") : -len("```")])


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1 and V3.2: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>
    (the arguments as bare JSON), in the same run of calls."""

    def parse(self, body: str) -> ParsedCall | None:
        name, sep, args = body.partition(self.sep)
        return _arguments(name.strip(), args) if sep and name.strip() else None


class Step3Parser(TaggedJsonParser):
    """Step-3: a run of calls between <｜tool_calls_begin｜> and <｜tool_calls_end｜>, each
    <｜tool_call_begin｜>function<｜tool_sep｜> then a steptml invoke, then <｜tool_call_end｜>:
    <steptml:invoke name="NAME"><steptml:parameter name="KEY">VALUE</steptml:parameter>...
    </steptml:invoke>. Values are text, typed by the tool's schema as vLLM types them
    (integer, number, boolean, null; objects and arrays from their JSON too)."""

    keeps_special_tokens = True
    open_tag = "<｜tool_call_begin｜>"
    close_tag = "<｜tool_call_end｜>"
    wrapper_tags = ("<｜tool_calls_begin｜>", "<｜tool_calls_end｜>")
    sep = "<｜tool_sep｜>"

    def parse(self, body: str) -> ParsedCall | None:
        kind, sep, invoke = body.partition(self.sep)
        m = _INVOKE.fullmatch(invoke.strip())
        if not sep or kind.strip() != "function" or m is None:
            return None
        name, params = m.group(1), m.group(2)
        found = _PARAM.findall(params)
        if _PARAM.sub("", params).strip():  # something besides parameters: not a call
            return None
        props = self.schemas.get(name, {}).get("properties", {})
        args = {k: _typed(html.unescape(v).strip(), props.get(k, {})) for k, v in found}
        return ParsedCall(name, json.dumps(args, ensure_ascii=False))


_INVOKE = re.compile(r'<steptml:invoke name="([^"]+)">(.*)</steptml:invoke>', re.DOTALL)
_PARAM = re.compile(r'<steptml:parameter name="([^"]+)">(.*?)</steptml:parameter>', re.DOTALL)


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as its schema's type says; the text itself where it does not fit."""
    kind = schema.get("type")
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind == "null" and value.lower() == "null":
            return None
        if kind in ("object", "array"):
            got = json.loads(value)
            return got if isinstance(got, dict if kind == "object" else list) else value
    except (ValueError, RecursionError):
        pass
    return value


class MistralParser(ToolCallParser):
    """Mistral (Mixtral-8x22B-Instruct, Mistral Small, ...): [TOOL_CALLS] then the calls,
    either a JSON list of {"name": ..., "arguments": {...}} or, from the v11 tokenizer on,
    NAME[ARGS]{...} after each [TOOL_CALLS]. The calls run to the end of the output: a JSON
    list is read there; a NAME[ARGS]{...} call as soon as the next [TOOL_CALLS] shows that it
    is whole (a stream gets each call as it completes). [TOOL_CALLS] is a special token;
    Mistral's templates want call ids of 9 letters and digits."""

    keeps_special_tokens = True
    tag = "[TOOL_CALLS]"
    args_tag = "[ARGS]"

    def __init__(self) -> None:
        self._buf = ""
        self._calls: str | None = None  # the text after the first tag, once it came

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._calls is not None:
            self._calls += text
            return "", self._whole_calls()
        self._buf += text
        at = self._buf.find(self.tag)
        if at >= 0:
            content, self._calls = self._buf[:at].rstrip(), self._buf[at + len(self.tag) :]
            self._buf = ""
            return content, []
        keep = held_back(self._buf, self.tag)
        sure = self._buf[: len(self._buf) - keep].rstrip()  # blanks before a call are its own
        self._buf = self._buf[len(sure) :]
        return sure, []

    def _whole_calls(self) -> list[ParsedCall]:
        """The NAME[ARGS]{...} calls that a later [TOOL_CALLS] closed, taken out of the text
        still to read (none while any of them does not read as a call: finish decides)."""
        assert self._calls is not None
        *whole, rest = self._calls.split(self.tag)
        if not whole or self.args_tag not in whole[0]:
            return []
        calls = self._read(self.tag.join(whole))
        if calls:
            self._calls = rest
        return calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self._calls is None:
            held, self._buf = self._buf, ""
            return held, []
        body, self._calls = self._calls, None
        calls = self._read(body)
        return ("", calls) if calls else (self.tag + body, [])  # not calls: as written

    def _read(self, body: str) -> list[ParsedCall]:
        if self.args_tag in body:  # NAME[ARGS]{...}, one after each tag
            calls = []
            for part in body.split(self.tag):
                name, sep, args = part.partition(self.args_tag)
                call = _arguments(name.strip(), args) if sep and name.strip() else None
                if call is None:
                    return []
                calls.append(call)
            return calls
        try:
            items: Any = json.loads(body)
        except (ValueError, RecursionError):
            return []
        items = items if isinstance(items, list) else [items]
        calls = [_from_object(it) for it in items]
        return [c for c in calls if c is not None] if calls and None not in calls else []

    @staticmethod
    def new_id() -> str:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class _Without:
    """A stream of text with every `tags` taken out, holding back what may still be one."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        self.tags = tags
        self._held = ""

    def feed(self, text: str) -> str:
        if not self.tags:
            return text
        buf = self._held + text
        for t in self.tags:
            buf = buf.replace(t, "")
        keep = max(held_back(buf, t) for t in self.tags)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        held, self._held = self._held, ""
        return held


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
    return _from_object(obj)


def _from_object(obj: Any) -> ParsedCall | None:
    """{"name": ..., "arguments": {...} or its JSON text} as a call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments' JSON as a string
        return _arguments(obj["name"], args)
    return (
        ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
        if isinstance(args, dict)
        else None
    )


def _arguments(name: str, args_json: str) -> ParsedCall | None:
    """A call to `name` whose arguments are the JSON object `args_json`; None if they are not."""
    try:
        args = json.loads(args_json)
    except (ValueError, RecursionError):
        return None
    return (
        ParsedCall(name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
    )


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
    "mistral": MistralParser,
    "step3": Step3Parser,
}


def keeps_special_tokens(name: str) -> bool:
    """Whether parser `name` reads special tokens, so its choices' text must keep them."""
    parser = PARSERS.get(name)
    return parser is not None and parser.keeps_special_tokens
