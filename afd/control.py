"""The control plane's contract (gateway <-> attention server), the twin of `afd/wire.py`.

The types both sides speak: a generation request with its sampling parameters (defined in
`afd/sampling.py`, with the checks they make on themselves), the token event an engine step
emits for it, one logprob type, the health and load answers, and the one
error-code enum (`afd.errors.ErrorCode`). This module holds the only conversions between them
and the protobufs of `protos/afd/v1/control.proto`; nothing else imports `control_pb2`. It
imports neither torch nor any service, so the gateway can use it without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from afd.errors import ErrorCode
from afd.protos import ensure_generated
from afd.sampling import SamplingParams

ensure_generated()

from afd.v1 import control_pb2 as pb  # noqa: E402 - generated on first use just above
from afd.v1 import control_pb2_grpc as pb_grpc  # noqa: E402

_CODE_TO_PB = {
    ErrorCode.NONE: pb.ERROR_NONE,
    ErrorCode.INVALID_REQUEST: pb.ERROR_INVALID_REQUEST,
    ErrorCode.UNAVAILABLE: pb.ERROR_UNAVAILABLE,
    ErrorCode.OVERLOADED: pb.ERROR_OVERLOADED,
    ErrorCode.INTERNAL: pb.ERROR_INTERNAL,
}
_CODE_FROM_PB = {v: k for k, v in _CODE_TO_PB.items()}


class Logprob(NamedTuple):
    """One token (generated, or of the prompt) with its log-probability and the top
    alternatives' (token id, log-probability), under the model's own distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """What one engine step gave one request: its new tokens (in order), or its end. The last
    event of a request has finish_reason set ("stop" | "length" | "abort" | "error")."""

    request_id: str
    token_ids: list[int]
    logprobs: list[Logprob] = field(default_factory=list)  # one per token id, when asked
    finish_reason: str = ""
    error_code: ErrorCode = ErrorCode.NONE
    error: str = ""  # why, in one line, when error_code is set
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    queue_seconds: float = 0.0  # arrival -> first scheduled (first event only)
    # prompt tokens 1 .. n-1 given the tokens before each, when asked (first event only)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache supplied
    # the request's last token is the EOS or stop token that ended it (last event only)
    stop_token: bool = False

    @staticmethod
    def failure(request_id: str, code: ErrorCode, message: str) -> TokenEvent:
        return TokenEvent(request_id, [], finish_reason="error", error_code=code, error=message)

    @property
    def failed(self) -> bool:
        return self.error_code is not ErrorCode.NONE or self.finish_reason == "error"


@dataclass(frozen=True)
class Health:
    live: bool
    ready: bool  # model loaded and the FFN pool covers every expert
    reason: str  # why not ready
    model: str
    max_model_len: int
    draining: bool = False  # shutting down: finishing the requests in flight only


@dataclass(frozen=True)
class Stats:
    running: int
    waiting: int
    kv_usage: float  # 0..1
    preemptions: int = 0
    draining: bool = False  # shutting down: route new requests elsewhere
    prefix_queries: int = 0  # prompt tokens admitted, since start
    prefix_hits: int = 0  # ... of them supplied by the prefix cache


# ---- protobuf conversions ----------------------------------------------------------------


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        cache_salt=s.cache_salt,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_p=s.min_p,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
        guide_kind=s.guide_kind,
        guide=s.guide,
        guide_after=list(s.guide_after),
        bad_words=[pb.TokenIds(ids=w) for w in s.bad_words],
        allowed_token_ids=list(s.allowed_token_ids),
        priority=s.priority,
    )
    if s.repetition_penalty != 1.0:
        msg.repetition_penalty = s.repetition_penalty
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    return msg


def sampling_from_pb(s: pb.SamplingParams) -> SamplingParams:
    """Raises RequestError for values no request may carry (a peer's bug or a hostile one)."""
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p if s.top_p > 0 else 1.0,  # proto3's unset float reads as 0
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        cache_salt=s.cache_salt,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        min_p=s.min_p,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens,
        guide_kind=s.guide_kind,
        guide=s.guide,
        guide_after=tuple(s.guide_after),
        bad_words=tuple(tuple(w.ids) for w in s.bad_words),
        allowed_token_ids=tuple(s.allowed_token_ids),
        priority=s.priority,
    )


def request_to_pb(r: GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        sampling=sampling_to_pb(r.sampling),
    )


def request_from_pb(r: pb.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(r.request_id, list(r.prompt_token_ids), sampling_from_pb(r.sampling))


def event_to_pb(ev: TokenEvent) -> pb.TokenEvent:
    return pb.TokenEvent(
        request_id=ev.request_id,
        token_ids=ev.token_ids,
        logprobs=[
            pb.TokenLogprobs(
                logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
            )
            for lp in ev.logprobs
        ],
        finish_reason=ev.finish_reason,
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        error_code=_CODE_TO_PB[ev.error_code],
        error=ev.error,
        queue_seconds=ev.queue_seconds,
        cached_tokens=ev.cached_tokens,
        stop_token=ev.stop_token,
        prompt_logprobs=[
            pb.TokenLogprobs(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
            for lp in ev.prompt_logprobs
        ],
    )


def event_from_pb(ev: pb.TokenEvent) -> TokenEvent:
    token_ids = list(ev.token_ids)
    return TokenEvent(
        request_id=ev.request_id,
        token_ids=token_ids,
        # the wire leaves the token id out of each entry: it is token_ids[i]
        logprobs=[
            Logprob(t, lp.logprob, [(a.token_id, a.logprob) for a in lp.top])
            for t, lp in zip(token_ids, ev.logprobs, strict=False)
        ],
        finish_reason=ev.finish_reason,
        error_code=_CODE_FROM_PB.get(ev.error_code, ErrorCode.INTERNAL),
        error=ev.error,
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        queue_seconds=ev.queue_seconds,
        cached_tokens=ev.cached_tokens,
        stop_token=ev.stop_token,
        prompt_logprobs=[
            Logprob(lp.token_id, lp.logprob, [(a.token_id, a.logprob) for a in lp.top])
            for lp in ev.prompt_logprobs
        ],
    )


def health_to_pb(h: Health) -> pb.HealthReply:
    return pb.HealthReply(
        live=h.live,
        ready=h.ready,
        reason=h.reason,
        model=h.model,
        max_model_len=h.max_model_len,
        draining=h.draining,
    )


def health_from_pb(r: pb.HealthReply) -> Health:
    return Health(r.live, r.ready, r.reason, r.model, r.max_model_len, r.draining)


def stats_to_pb(s: Stats) -> pb.StatsReply:
    return pb.StatsReply(
        running=s.running,
        waiting=s.waiting,
        kv_usage=s.kv_usage,
        preemptions=s.preemptions,
        draining=s.draining,
        prefix_queries=s.prefix_queries,
        prefix_hits=s.prefix_hits,
    )


def stats_from_pb(r: pb.StatsReply) -> Stats:
    load = (r.running, r.waiting, r.kv_usage, r.preemptions)
    return Stats(*load, r.draining, r.prefix_queries, r.prefix_hits)


__all__ = [
    "ErrorCode",
    "GenerateRequest",
    "Health",
    "Logprob",
    "SamplingParams",
    "Stats",
    "TokenEvent",
    "event_from_pb",
    "event_to_pb",
    "health_from_pb",
    "health_to_pb",
    "pb",
    "pb_grpc",
    "request_from_pb",
    "request_to_pb",
    "sampling_from_pb",
    "sampling_to_pb",
    "stats_from_pb",
    "stats_to_pb",
]
