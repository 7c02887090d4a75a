"""A validated request's prompts -> one ChoiceSpec per choice: checked against the context,
with the SamplingParams the attention server gets (the model's sampling defaults where the
request leaves a field out, guides, special-token and stop-string handling)."""

from __future__ import annotations

import secrets
from typing import Any

from afd.control import SamplingParams
from afd.errors import RequestError
from services.gateway.answers import guide_marker
from services.gateway.errors import invalid
from services.gateway.generation import ChoiceSpec
from services.gateway.handlers import GatewayState
from services.gateway.prompts import bad_word_ids, check_token_ids
from services.gateway.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from services.gateway.tool_parsers import keeps_special_tokens

_INT64 = 2**63


def _seed(seed: int | None, j: int) -> int | None:
    # Choice j gets seed + j: choices differ, and the same request reproduces all of them.
    if seed is None:
        return None
    return (seed + j + _INT64) % (2 * _INT64) - _INT64


async def plan(
    state: GatewayState,
    req: ChatCompletionRequest | CompletionRequest,
    prompts: list[tuple[list[int], str]],
    request_id: str,
) -> list[ChoiceSpec]:
    """One ChoiceSpec per (prompt, choice), checked against the context length."""
    _check_logprobs(state, req)
    if len(prompts) * req.n > MAX_CHOICES:
        raise invalid(
            f"{len(prompts)} prompts x n={req.n} asks for {len(prompts) * req.n} choices; "
            f"at most {MAX_CHOICES} per request",
            "n",
        )
    limit = state.max_tokens_limit
    if limit and req.max_new_tokens and req.max_new_tokens > limit:
        raise invalid(
            f"max_tokens is {req.max_new_tokens}; this server allows at most {limit}",
            "max_tokens",
        )
    bias = req.token_bias
    guide_kind, guide = req.guide
    model = _model_defaults(state, req)
    # a harmony answer's structure is special tokens: its reader needs them in the text (a
    # tool_choice guide leaves the model no harmony; another guide holds in the final body)
    chat = isinstance(req, ChatCompletionRequest)
    calls_guide = chat and req.tool_mode in ("required", "named")
    harmony = chat and state.chat_format == "harmony" and not calls_guide
    # a tool-call format written in special tokens is read from a text that keeps them
    tags = chat and req.tool_mode == "auto" and keeps_special_tokens(state.tool_parser)
    text_model = state.chat_format != "harmony"
    waits = chat and guide_kind and (harmony or (text_model and bool(state.reasoning_parser)))
    check_token_ids(state, [t for t, _ in bias], "logit_bias")
    check_token_ids(state, req.stop_token_ids or [], "stop_token_ids")
    check_token_ids(state, req.allowed_token_ids or [], "allowed_token_ids")
    bad_words = bad_word_ids(state, req.bad_words)
    await state.balancer.wait_started(state.startup_wait_s)
    max_len = await state.balancer.max_model_len()
    param = "messages" if chat else "prompt"
    nonce = secrets.token_hex(3)  # attention-side ids stay unique if a client reuses its id
    specs = []
    keep = req.truncate_prompt_tokens
    if keep == 0:
        raise invalid(
            "truncate_prompt_tokens must be -1 (the context) or >= 1", "truncate_prompt_tokens"
        )
    for p, (ids, echo) in enumerate(prompts):
        if not ids:
            raise invalid("the prompt is empty", param)
        if keep is not None:  # vLLM's: the prompt's last tokens
            ids = ids[-(max_len if keep == -1 else keep) :]
        if len(ids) >= max_len:
            raise invalid(
                f"the prompt has {len(ids)} tokens; this model's context is {max_len} tokens",
                param,
                "context_length_exceeded",
            )
        room = max_len - len(ids)
        max_tokens = req.max_new_tokens
        if max_tokens is None:
            max_tokens = min(room, limit) if limit else room
            max_tokens = min(max_tokens, model.get("max_tokens", max_tokens))
        if max_tokens > room:
            raise invalid(
                f"max_tokens is {max_tokens}, but the prompt ({len(ids)} tokens) leaves room for "
                f"only {room} of this model's {max_len}-token context",
                "max_tokens",
                "context_length_exceeded",
            )
        if req.min_tokens > max_tokens:
            raise invalid(
                f"min_tokens is {req.min_tokens}, more than max_tokens ({max_tokens})",
                "min_tokens",
            )
        after = (
            guide_marker(state.tokenizer, ids, state.chat_format, state.reasoning_parser)
            if waits
            else ()
        )
        for c in range(req.n):
            j = p * req.n + c
            params = _sampling(
                max_tokens=max_tokens,
                temperature=model.get("temperature", req.temperature),
                top_p=model.get("top_p", req.top_p),
                top_k=max(model.get("top_k", req.top_k), 0),
                seed=_seed(req.seed, j),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=req.num_logprobs,
                prompt_logprobs=_prompt_logprobs(req),
                cache_salt=req.cache_salt or "",
                logit_bias=bias,
                repetition_penalty=model.get("repetition_penalty", req.repetition_penalty),
                frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty,
                min_p=model.get("min_p", req.min_p),
                min_tokens=req.min_tokens,
                guide_kind=guide_kind,
                guide=guide,
                guide_after=after,
                bad_words=bad_words,
                allowed_token_ids=tuple(req.allowed_token_ids or ()),
                priority=req.priority,
            )
            spec = ChoiceSpec(
                j, f"{request_id}.{nonce}.{j}", ids, params, req.stop_strings, echo,
                echo_logprobs=_echo_logprobs(req),
                keep_special_tokens=harmony or not req.skip_special_tokens or tags,
                include_stop=req.include_stop_str_in_output,
            )  # fmt: skip
            specs.append(spec)
    return specs


def _model_defaults(
    state: GatewayState, req: ChatCompletionRequest | CompletionRequest
) -> dict[str, Any]:
    """The model's sampling defaults (its generation_config.json, as vLLM reads it) for the
    fields this request leaves out."""
    given = req.model_fields_set
    return {k: v for k, v in state.sampling_defaults.items() if k not in given}


def _sampling(**fields) -> SamplingParams:
    """The control plane's parameters; a value the schema let through but they refuse (a
    combination, say) is still the client's 400."""
    try:
        return SamplingParams(**fields)
    except RequestError as e:
        raise invalid(str(e)) from None


def _check_logprobs(state: GatewayState, req: ChatCompletionRequest | CompletionRequest) -> None:
    """vLLM's --max-logprobs (-1: the vocabulary) bounds every count of alternatives asked."""
    limit = state.vocab_size if state.max_logprobs < 0 else state.max_logprobs
    for name, n in (("logprobs", req.num_logprobs), ("prompt_logprobs", _prompt_logprobs(req))):
        if n is not None and n > limit:
            raise invalid(
                f"{n} {name} were asked for; this server returns at most {limit} (--max-logprobs)",
                "top_logprobs"
                if name == "logprobs" and isinstance(req, ChatCompletionRequest)
                else name,
            )


def _prompt_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    return req.num_prompt_logprobs if isinstance(req, CompletionRequest) else req.prompt_logprobs


def _echo_logprobs(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return isinstance(req, CompletionRequest) and req.echo_logprobs
