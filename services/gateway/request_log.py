"""vLLM's request logging (`--enable-log-requests`, `--enable-log-outputs`, `--max-log-len`):
one line per request as it starts (its prompt and the sampling parameters that differ from
the defaults) and one per choice as it finishes (its text, finish reason and token count),
at INFO on the gateway's logger. Off by default: prompts and answers are users' data."""

from __future__ import annotations

import dataclasses
import logging

from afd.sampling import SamplingParams
from services.gateway.generation import ChoiceSpec, ChoiceStreams

log = logging.getLogger("afd.gateway.requests")

_DEFAULTS = SamplingParams()


class RequestLog:
    def __init__(self, decode, outputs: bool, max_len: int = 0):
        self._decode = decode  # token ids -> text (the model's tokenizer)
        self.outputs = outputs  # log each choice's output as it finishes
        self._max_len = max_len  # characters of a prompt or output shown (0: all)

    def received(self, request_id: str, specs: list[ChoiceSpec]) -> None:
        """A request's choices as planned: one line per distinct prompt."""
        prompts: dict[tuple[int, ...], list[ChoiceSpec]] = {}
        for spec in specs:
            prompts.setdefault(tuple(spec.prompt_ids), []).append(spec)
        for ids, same in prompts.items():
            log.info(
                "request %s: prompt of %d tokens %r, %d choice(s), params %s",
                request_id,
                len(ids),
                self._clip(self._decode(list(ids), skip_special_tokens=False)),
                len(same),
                _changed(same[0].params),
            )

    def finished(self, streams: ChoiceStreams) -> None:
        for run, text in zip(streams.runs, streams.texts, strict=True):
            log.info(
                "output of %s: %r, finish %s, %d tokens",  # the attention side's choice id
                run.spec.request_id,
                self._clip("".join(text)),
                run.finish_reason,
                run.completion_tokens,
            )

    def _clip(self, text: str) -> str:
        return text[: self._max_len] if self._max_len else text


def _changed(params: SamplingParams) -> str:
    """The parameters other than their defaults, as name=value."""
    out = []
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if value != getattr(_DEFAULTS, f.name) and f.name not in ("guide",):
            out.append(f"{f.name}={value!r}")
    if params.guide:
        out.append(f"guide=<{len(params.guide)} characters>")
    return ", ".join(out) or "defaults"
