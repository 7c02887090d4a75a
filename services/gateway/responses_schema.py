"""OpenAI's Responses API request (`POST /v1/responses`) as pydantic models, and its one
translation: into the chat request the gateway already serves (messages, tools, guide).

An input is a string (one user message) or a list of items: messages (text parts), the
model's earlier function calls and reasoning, and the calls' outputs. A conversation goes in
whole, or goes on from a stored response (`previous_response_id`: its conversation and output
come first; response_store.py); OpenAI's Conversations API (`conversation`) is not served.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from services.gateway.chat_messages import MAX_TOOLS, FunctionName
from services.gateway.errors import invalid, validation_message
from services.gateway.schema_base import INT64, Bool, Float, Int
from services.gateway.schema_base import Model as _Model
from services.gateway.schemas import ChatCompletionRequest

MAX_ITEMS = 4096  # input items of one request


class InputPart(_Model):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class InputMessage(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]

    @property
    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: FunctionName
    arguments: str


class FunctionCallOutput(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    content: list[InputPart] | None = None
    summary: list[InputPart] = []


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutput | ReasoningItem, Field(union_mode="smart")
]
ITEMS = TypeAdapter(list[InputItem])  # a stored conversation's items, read back


class FunctionTool(_Model):
    """The Responses API's function tool: flat, unlike chat's {"function": {...}}."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class NamedFunction(_Model):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class TextOptions(_Model):
    format: TextFormat | None = None


class Reasoning(_Model):
    effort: Literal["minimal", "low", "medium", "high"] | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: str | None = None
    max_output_tokens: Annotated[Int, Field(ge=1, le=INT64)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    priority: Int = 0  # vLLM extra, as on a chat (checked there)
    # each output token's logprob, with this many alternatives (OpenAI's: with include
    # "message.output_text.logprobs")
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None  # only "message.output_text.logprobs" changes anything
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: Bool = True
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    stream: Bool = False
    store: Bool = True  # OpenAI's default: kept for GET and previous_response_id
    background: Bool = False  # answered at once (queued); GET it until it is done
    # auto: the oldest items dropped where the conversation outgrows the context
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    conversation: Any = None

    @model_validator(mode="after")
    def _served(self) -> ResponsesRequest:
        if self.conversation is not None:
            raise ValueError(
                "conversation objects are not served; go on from a stored response with "
                "previous_response_id, or send the whole conversation as input"
            )
        if self.background and not self.store:
            raise ValueError("a background response needs store: true (it is fetched by id)")
        return self

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as the API lists items (GET .../input_items): each with an
        id and a status, a message's text as content parts (a string input is one user
        message)."""
        items = (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        return [_listed(i) for i in items]

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())

    def to_chat(
        self, instructions_role: str = "system", history: list[dict[str, Any]] = ()
    ) -> ChatCompletionRequest:
        """The same request as a chat completion, `instructions` as a message of that role
        (gpt-oss's template reads them from the developer's), after the `history` items (a
        stored response's conversation; its instructions are not carried over, as OpenAI's
        are not); a combination the chat request refuses is the client's 400."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(instructions_role, ITEMS.validate_python(list(history))),
            "parallel_tool_calls": self.parallel_tool_calls,
            "priority": self.priority,
        }
        # only those given: the model's sampling defaults fill the rest, as in a chat
        body |= {
            k: getattr(self, k) for k in ("temperature", "top_p") if k in self.model_fields_set
        }
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.wants_logprobs:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise invalid("text.format of type json_schema needs a schema", "text.format")
            schema = {"name": fmt.name or "output", "schema": fmt.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.reasoning is not None and self.reasoning.effort is not None:
            # the variable gpt-oss's template reads
            body["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            msg, param = validation_message(e.errors(include_url=False))
            raise invalid(msg, param=param) from None

    def _messages(self, instructions_role: str, history: list[Any]) -> list[dict[str, Any]]:
        """The input as chat messages: consecutive function calls join one assistant message
        (after its text, if the message just before is the assistant's), a reasoning item
        goes with the assistant message or calls that follow it."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": instructions_role, "content": self.instructions})
        items = history + (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        thought: str | None = None
        for item in items:
            if isinstance(item, ReasoningItem):
                thought = "".join(p.text for p in (item.content or item.summary))
                continue
            if isinstance(item, FunctionCallOutput):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and thought is None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append({"role": item.role, "content": item.text})
            if thought is not None and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"] = thought
            thought = None
        return out


_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _listed(item: Any) -> dict[str, Any]:
    out = item.model_dump(exclude_none=True)
    if isinstance(item, InputMessage):
        kind = "output_text" if item.role == "assistant" else "input_text"
        parts = (
            [{"type": kind, "text": item.content}]
            if isinstance(item.content, str)
            else out["content"]
        )
        if item.role == "assistant":
            parts = [{**p, "annotations": []} for p in parts]
        out["content"] = parts
    if not isinstance(item, ReasoningItem):
        out["status"] = "completed"
    return {"id": f"{_ID_PREFIX[out['type']]}_{secrets.token_hex(12)}", **out}
