"""OpenAI request bodies as pydantic models: the only place the gateway checks a field's type
and range (the base and its strict types: schema_base.py; a chat's messages and tools:
chat_messages.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from afd.sampling import (
    LOGIT_BIAS_LIMIT,
    MAX_ALLOWED_TOKENS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT,
    MAX_GUIDE,
    MAX_LOGIT_BIAS,
    PRIORITY_LIMIT,
)
from services.gateway import structured, tool_calls
from services.gateway.chat_messages import MAX_TOOLS, ChatMessage, NamedToolChoice, Tool
from services.gateway.schema_base import INT64, Bool, Float, Int
from services.gateway.schema_base import Model as _Model
from services.gateway.structured import GuideText, ResponseFormat, StructuredOutputs

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 128  # prompts x n: generations one request may start
MAX_STOP = 16  # stop strings
MAX_STOP_LEN = 256  # characters in one stop string
# logprobs a request may ask for, at most: the server's --max-logprobs is checked with the model
# (services/gateway/choices.py); this only bounds what is parsed
MAX_TOP_LOGPROBS = 1 << 20
MAX_STOP_TOKEN_IDS = 64

TokenId = Annotated[StrictInt, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN, pattern=r"\S")]
StopTokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]  # int32 on the control plane


class StreamOptions(_Model):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's: every chunk's usage is the count so far


class _SamplingRequest(_Model):
    """Fields shared by chat and completions."""

    model: str | None = None
    max_tokens: Annotated[Int, Field(ge=1, le=INT64)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[Int, Field(ge=-1, le=1 << 30)] = 0  # vLLM extra; 0 or -1: off
    seed: Annotated[Int, Field(ge=-(2**63), le=INT64)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    # vLLM extra: finish ("stop") when any of these tokens is generated, as with EOS
    stop_token_ids: Annotated[list[StopTokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's penalties on the tokens generated so far (afd.control.SamplingParams)
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] = 0.0
    # vLLM extra: on the prompt's tokens and the output's, a positive logit divided by it and
    # another multiplied (1: off)
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=1e6)] = 1.0
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.0  # vLLM extra
    # vLLM extra: no EOS, stop token or stop string ends the output before this many tokens
    min_tokens: Annotated[Int, Field(ge=0, le=INT64)] = 0
    # token id (a string, as JSON keys are) -> bias added to its logit
    logit_bias: (
        Annotated[
            dict[str, Annotated[Float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    ignore_eos: Bool = False  # vLLM extra: generate max_tokens whatever the model says
    # vLLM extras: special tokens in the text; the stop string or stop token (EOS too) that
    # ended the output in its text
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    # vLLM extras: a prompt longer than this keeps its last this-many tokens (-1: the model's
    # context); logprobs name tokens as "token_id:N"
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1, le=INT64)] | None = None
    return_tokens_as_token_ids: Bool = False
    # vLLM extras: words the output may not contain (their last token cannot follow the rest),
    # and the only tokens it may be made of
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS // 2)] | None = None
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKENS)] | None
    ) = None
    # vLLM extra: requests with different salts share no prefix-cache blocks
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # vLLM extra: under `--scheduling-policy priority`, lower is served first (else only 0)
    priority: Annotated[Int, Field(ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)] = 0
    # vLLM extras: beam search, n its width (services/gateway/beam_search.py)
    use_beam_search: Bool = False
    return_token_ids: Bool = False  # vLLM extra: the prompt's and each choice's token ids
    length_penalty: Annotated[Float, Field(ge=-100.0, le=100.0)] = 1.0
    user: str | None = None

    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or its older
    # guided_* fields; at most one of them constrains a request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | GuideText | None = None
    guided_regex: GuideText | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: GuideText | None = None

    @model_validator(mode="after")
    def _one_guide(self) -> _SamplingRequest:
        found = self._guides()
        if len(found) > 1:
            raise ValueError(
                "only one of response_format, structured_outputs, guided_* and a tool_choice "
                f"of required or a named function may constrain the output; got {len(found)}"
            )
        if found and len(found[0][1]) > MAX_GUIDE:
            raise ValueError(f"the output's guide is longer than {MAX_GUIDE} characters")
        return self

    def _guides(self) -> list[tuple[str, str]]:
        legacy = {
            k: getattr(self, k)
            for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        }
        return structured.guides(self.response_format, self.structured_outputs, legacy)

    @property
    def guide(self) -> tuple[str, str]:
        """(kind, guide) as afd.control.SamplingParams takes them; ("", "") for free text."""
        found = self._guides()
        return found[0] if found else ("", "")

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids; got {key!r}")
        return bias

    @property
    def token_bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, in token order."""
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        so = self.stream_options
        return self.include_usage and so is not None and so.continuous_usage_stats


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1, le=INT64)] | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # vLLM extra: each prompt token's logprob and the top n, as the response's prompt_logprobs
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: Bool = True  # vLLM extra
    add_special_tokens: Bool = False  # vLLM extra: the template writes BOS and the like itself
    # vLLM extras: the prompt ends inside the last message (the model goes on with it), and
    # the answer starts with the last message's text when it is the assistant's
    continue_final_message: Bool = False
    echo: Bool = False
    # vLLM extra: more variables for the chat template (Qwen3's enable_thinking, say)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; reaches the template as the variable gpt-oss's reads (as vLLM passes it)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not streamed")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        _check_continue(self.continue_final_message, self.add_generation_prompt)
        return self

    @property
    def echoed(self) -> str:
        """vLLM's chat echo: the text the answer starts with (the last message's, when it is
        the assistant's; its text parts joined by newlines, as vLLM reads them)."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        c = last.content
        return c if isinstance(c, str) else "\n".join(p.text for p in c)

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named: what the answer may or must call."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the guides take them."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def called_tool(self) -> str:
        """The function a named tool_choice forces; "" otherwise."""
        c = self.tool_choice
        return c.function.name if isinstance(c, NamedToolChoice) else ""

    def _guides(self) -> list[tuple[str, str]]:
        out = super()._guides()
        if self.tool_mode in ("required", "named") and self.tools:
            schema = tool_calls.guide_schema(
                self.tool_dicts or [], self.called_tool, self.parallel_tool_calls
            )
            if schema is not None:
                out.append(("json", json.dumps(schema)))
        return out

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the sampled token's and the top k alternatives'."""
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    # the OpenAI default here; 0 with echo scores the prompt only (lm-eval, perplexity)
    max_tokens: Annotated[Int, Field(ge=0, le=INT64)] | None = 16
    echo: Bool = False
    logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # OpenAI's: 5
    suffix: str | None = None
    # vLLM extra: a text prompt gets the tokenizer's own special tokens (the BOS of Llama,
    # Mistral and DeepSeek tokenizers), as transformers' tokenizer(text) does
    add_special_tokens: Bool = True
    # vLLM extra: each prompt token's logprob and the top n, as `prompt_logprobs` in a choice
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not streamed; use echo with logprobs")
        if len(self.prompts()) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Every prompt, each a string or a list of token ids (the four OpenAI shapes)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt carries logprobs (the prompt's own, after its first token)."""
        return self.echo and self.logprobs is not None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """None: prompt logprobs not needed; k: each prompt token's plus the top k."""
        wanted = [n for n in (self.prompt_logprobs, self.echo_logprobs and self.logprobs) if n]
        if self.prompt_logprobs is None and not self.echo_logprobs:
            return None
        return max(wanted, default=0)


class TokenizeRequest(_Model):
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: Bool | None = None  # vLLM's defaults: a prompt's yes, a chat's no
    return_token_strs: Bool = False  # vLLM extra: each token as the vocabulary spells it

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        _check_continue(self.continue_final_message, self.add_generation_prompt)
        return self


def _check_continue(continue_final_message: bool, add_generation_prompt: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false to continue the last message"
        )


class DetokenizeRequest(_Model):
    tokens: list[TokenId]
