"""A chat's messages and tools as OpenAI sends them (pydantic), and each message as the chat
template sees it."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from services.gateway.schema_base import Bool
from services.gateway.schema_base import Model as _Model

MAX_TOOLS = 128


class ContentPart(_Model):
    type: str
    text: str | None = None


# OpenAI's rule for function names
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionDefinition(_Model):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: Bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(_Model):
    name: FunctionName


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionRef


class CalledFunction(_Model):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends the JSON text; a template wants the object


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    # an assistant's earlier reasoning, under any of its names (vLLM's, gpt-oss templates')
    reasoning_content: str | None = None
    thinking: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ChatMessage:
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(
                        f"content part of type {part.type!r} is not supported; only text parts"
                    )
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls; only an assistant's")
        for call in self.tool_calls or ():
            args = call.function.arguments
            if isinstance(args, str) and not isinstance(_json_or_none(args), dict):
                raise ValueError(
                    f"the arguments of the call to {call.function.name!r} are not a JSON object"
                )
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (no None fields). Calls' arguments are
        objects, as vLLM gives them to templates (which write them with tojson)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if isinstance(self.content, list):
            d["content"] = [{"type": "text", "text": p.text} for p in self.content]
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        # as transformers gives it: reasoning_content from whichever name came, and thinking
        # (which gpt-oss's template reads) unless the message has its own
        named = {"reasoning_content": self.reasoning_content, "thinking": self.thinking}
        named["reasoning"] = self.reasoning
        given = {k: v for k, v in named.items() if v is not None}
        if given:
            first = next(iter(given.values()))
            d.update({"thinking": first, **given, "reasoning_content": first})
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    **({"id": c.id} if c.id is not None else {}),
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.arguments
                        if isinstance(c.function.arguments, dict)
                        else json.loads(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        return d


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return None
