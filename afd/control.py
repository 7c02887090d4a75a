"""The control plane's contract (gateway <-> attention server), the twin of `afd/wire.py`.

The types both sides speak: a generation request with its sampling parameters, the token
event an engine step emits for it, one logprob type, the health and load answers, and the one
error-code enum (`afd.errors.ErrorCode`). This module holds the only conversions between them
and the protobufs of `protos/afd/v1/control.proto`; nothing else imports `control_pb2`. It
imports neither torch nor any service, so the gateway can use it without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from afd.errors import ErrorCode, RequestError
from afd.protos import ensure_generated

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


MAX_CACHE_SALT = 1024  # characters
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for one bias: [-100, 100]
# Structured outputs: what a request's text is held to (services/attention/guides.py), and the
# guide's text for each kind: a JSON schema, nothing (any JSON object), a regular expression,
# a JSON list of strings (exactly one of them), an EBNF grammar
GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GUIDE = 1 << 16  # characters
MAX_GUIDE_AFTER = 16  # tokens of the marker a guide may wait for


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # finish ("stop") on any of these, besides EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's plus the top k
    # None: none; k >= 0: every prompt token's (after the first) given the tokens before it,
    # plus the top k (vLLM's prompt_logprobs; with max_tokens 0, a prompt is only scored)
    prompt_logprobs: int | None = None
    # vLLM's cache_salt: requests with different salts never share prefix-cache blocks (a
    # tenant's secret, so that another cannot learn from timings which prompts were sent)
    cache_salt: str = ""
    # Penalties and biases, applied to the logits in this order before any sampling (greedy
    # too), as vLLM does: logit_bias ((token id, bias) pairs, added), repetition_penalty (on
    # the tokens of the prompt and the output: a positive logit divided by it, another
    # multiplied; 1: off), then frequency_penalty times each token's count in the output and
    # presence_penalty once per token the output holds, subtracted (OpenAI's definition).
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # After temperature, before top-k and top-p: drop the tokens whose probability is below
    # min_p times the likeliest token's (0: off).
    min_p: float = 0.0
    # vLLM's: until this many tokens are out, EOS and stop_token_ids cannot be chosen (and the
    # gateway matches no stop string in their text)
    min_tokens: int = 0
    guide_kind: str = ""  # "" (free text) or one of GUIDE_KINDS
    guide: str = ""
    # the guide holds from the token after the output first holds these tokens (a thinking
    # model's end of reasoning, as vLLM starts structured outputs there); (): from the first
    guide_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        problem = ""
        if self.max_tokens < 0:
            problem = f"max_tokens must be >= 0, got {self.max_tokens}"
        elif self.temperature < 0:
            problem = f"temperature must be >= 0, got {self.temperature}"
        elif not 0.0 < self.top_p <= 1.0:
            problem = f"top_p must be in (0, 1], got {self.top_p}"
        elif self.logprobs is not None and self.logprobs < 0:
            problem = f"logprobs must be >= 0, got {self.logprobs}"
        elif self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            problem = f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"
        elif any(t < 0 for t in self.stop_token_ids):
            problem = "stop_token_ids must be >= 0"
        elif len(self.cache_salt) > MAX_CACHE_SALT:
            problem = f"cache_salt is longer than {MAX_CACHE_SALT} characters"
        elif not 0.0 < self.repetition_penalty <= 1e6:  # NaN fails too
            problem = f"repetition_penalty must be > 0, got {self.repetition_penalty}"
        elif not -2.0 <= self.frequency_penalty <= 2.0:
            problem = f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
        elif not -2.0 <= self.presence_penalty <= 2.0:
            problem = f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
        elif not 0.0 <= self.min_p <= 1.0:
            problem = f"min_p must be in [0, 1], got {self.min_p}"
        elif not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            problem = f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
        elif self.guide_kind and self.guide_kind not in GUIDE_KINDS:
            problem = f"guide_kind must be one of {', '.join(GUIDE_KINDS)}, got {self.guide_kind!r}"
        elif len(self.guide) > MAX_GUIDE:
            problem = f"the guide is longer than {MAX_GUIDE} characters"
        elif self.guide_kind in ("", "json_object") and self.guide:
            problem = f"guide_kind {self.guide_kind!r} takes no guide"
        elif self.guide_kind not in ("", "json_object") and not self.guide:
            problem = f"guide_kind {self.guide_kind!r} needs a guide"
        elif self.guide_after and (not self.guide_kind or len(self.guide_after) > MAX_GUIDE_AFTER):
            problem = f"guide_after needs a guide and at most {MAX_GUIDE_AFTER} tokens"
        elif any(t < 0 for t in self.guide_after):
            problem = "guide_after's token ids must be >= 0"
        else:
            problem = _logit_bias_problem(self.logit_bias)
        if problem:
            raise RequestError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes this request's logits before sampling."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )


def _logit_bias_problem(bias: tuple[tuple[int, float], ...]) -> str:
    if len(bias) > MAX_LOGIT_BIAS:
        return f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed"
    seen = set()
    for token, value in bias:
        if token < 0:
            return f"logit_bias names token {token}; token ids are >= 0"
        if token in seen:
            return f"logit_bias names token {token} twice"
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:  # NaN fails too
            return f"logit_bias for token {token} is {value}; it must be in [-100, 100]"
        seen.add(token)
    return ""


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
