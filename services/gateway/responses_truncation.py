"""The Responses API's `truncation: "auto"`: a conversation longer than the model's context
(a long chain of previous_response_id, most often) loses its oldest items until the prompt
and the output's room fit; `disabled` (the default) leaves it whole, and too long is a 400.

The kept part never starts with a call's output, so the template never sees the answer to a
call it lost. The kept tail is found by bisection over the starts, each tried by rendering the
template."""

from __future__ import annotations

from typing import Any

from services.gateway import handlers as h
from services.gateway import prompts
from services.gateway.responses_schema import ITEMS, FunctionCallOutput, ResponsesRequest
from services.gateway.schemas import ChatCompletionRequest


async def fit(
    state: h.GatewayState,
    req: ResponsesRequest,
    role: str,
    history: list[dict[str, Any]],
    chat: ChatCompletionRequest,
    ids: list[int],
) -> tuple[ChatCompletionRequest, list[int]]:
    """The chat and its prompt tokens, the oldest items dropped until it fits (unchanged
    where it fits already, or nothing can be dropped)."""
    await state.balancer.wait_started(state.startup_wait_s)
    room = await state.balancer.max_model_len() - (req.max_output_tokens or 1)
    if len(ids) <= room:
        return chat, ids
    items = ITEMS.validate_python([*history, *req.input_items()])
    starts = [k for k in range(1, len(items)) if not isinstance(items[k], FunctionCallOutput)]
    best: tuple[ChatCompletionRequest, list[int]] = (chat, ids)
    lo, hi = 0, len(starts) - 1
    while lo <= hi:  # the earliest start that fits: later starts keep less
        mid = (lo + hi) // 2
        tried = req.model_copy(update={"input": items[starts[mid] :]}).to_chat(role)
        tried_ids = await prompts.chat_prompt(state, tried)
        if len(tried_ids) <= room:
            best, hi = (tried, tried_ids), mid - 1
        else:
            lo = mid + 1
    return best
