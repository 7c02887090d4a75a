"""Requests -> prompt token ids: chat templates rendered off the event loop, completion
prompts as text or token ids, and the checks on both that run before anything is generated."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from afd.errors import AfdError
from services.gateway.errors import invalid
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from services.gateway.handlers import GatewayState


async def chat_prompt(state: GatewayState, req: ChatCompletionRequest) -> list[int]:
    """The chat's prompt tokens. The template renders on a worker thread with a time limit:
    a slow or runaway template is a 400 and never stalls the event loop."""
    messages = [m.template_dict() for m in req.messages]
    try:
        text = await asyncio.to_thread(
            state.tokenizer.apply_chat_template,
            messages,
            req.add_generation_prompt,
            state.template_timeout_s,
            req.tool_dicts,
            _template_kwargs(state, req),
            req.continue_final_message,
        )
    except AfdError as e:  # no template, a time or size limit
        raise invalid(f"cannot apply the chat template: {e}", param="messages") from None
    except Exception as e:  # whatever the template does with these messages (sandbox refusals,
        # type errors, runaway recursion) is the request's problem, not the server's
        raise invalid(
            f"cannot apply the chat template to these messages: {type(e).__name__}: {e}",
            param="messages",
        ) from None
    return state.tokenizer.encode(text, req.add_special_tokens)


def _template_kwargs(state: GatewayState, req: ChatCompletionRequest) -> dict | None:
    """The template's extra variables: the server's defaults, the request's reasoning_effort,
    then the request's own chat_template_kwargs (each overriding the one before)."""
    effort = {"reasoning_effort": req.reasoning_effort} if req.reasoning_effort else {}
    return {**state.chat_template_defaults, **effort, **(req.chat_template_kwargs or {})} or None


def check_tools(state: GatewayState, req: ChatCompletionRequest) -> None:
    """A tool_choice this server can honour (before anything runs)."""
    if req.tool_mode == "auto" and not state.tool_parser:
        raise invalid(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            'be set; or ask for tool_choice "required", "none" or a named function',
            "tool_choice",
        )


def completion_prompts(state: GatewayState, req: CompletionRequest) -> list[tuple[list[int], str]]:
    """Each prompt as (token ids, text to echo)."""
    out = []
    for p in req.prompts():
        if isinstance(p, str):
            out.append((state.tokenizer.encode(p, req.add_special_tokens), p if req.echo else ""))
        else:
            check_token_ids(state, p, "prompt")
            out.append((p, state.tokenizer.decode(p) if req.echo else ""))
    return out


def check_token_ids(state: GatewayState, ids: list[int], param: str) -> None:
    bad = next((t for t in ids if t >= state.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is out of range (vocabulary: {state.vocab_size})", param)


def bad_word_ids(state: GatewayState, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as written and after a blank (BPE
    tokenizers spell a word that starts the text and one that follows a space apart), each
    sequence once."""
    out: list[tuple[int, ...]] = []
    for w in words or ():
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tuple(state.tokenizer.encode(text))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)
