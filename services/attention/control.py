"""Conversion between the control-plane protobufs and the engine's plain types. Only this
module (and the gateway's client) import the generated control_pb2."""

from __future__ import annotations

from afd.protos import ensure_generated

ensure_generated()

from afd.v1 import control_pb2 as pb  # noqa: E402
from afd.v1 import control_pb2_grpc as pb_grpc  # noqa: E402
from services.attention.loop import Event  # noqa: E402
from services.attention.request import SamplingParams  # noqa: E402

ERROR_CODES = {
    "": pb.ERROR_NONE,
    "invalid_request": pb.ERROR_INVALID_REQUEST,
    "unavailable": pb.ERROR_UNAVAILABLE,
    "overloaded": pb.ERROR_OVERLOADED,
    "internal": pb.ERROR_INTERNAL,
}
ERROR_NAMES = {v: k for k, v in ERROR_CODES.items()}


def sampling_from_pb(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p if s.top_p > 0 else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
    )


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    return msg


def event_to_pb(ev: Event) -> pb.TokenEvent:
    return pb.TokenEvent(
        request_id=ev.request_id,
        token_ids=ev.token_ids,
        logprobs=[
            pb.TokenLogprobs(logprob=lp, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])
            for lp, top in ev.logprobs
        ],
        finish_reason=ev.finish_reason,
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        error_code=ERROR_CODES.get(ev.error_code, pb.ERROR_INTERNAL),
        error=ev.error,
        queue_seconds=ev.queue_seconds,
    )


__all__ = [
    "ERROR_CODES",
    "ERROR_NAMES",
    "event_to_pb",
    "pb",
    "pb_grpc",
    "sampling_from_pb",
    "sampling_to_pb",
]
