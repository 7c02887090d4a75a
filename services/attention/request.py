"""Per-request state on the attention server (plain Python, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from afd.control import Logprob, SamplingParams
from afd.errors import ErrorCode


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)  # one per token, when asked
    # prompt_logprobs[i]: prompt token i + 1 given tokens 0..i, when asked (kept through a
    # preemption: a recomputed prefill does not score them again)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    # prefix caching: the content hashes of the sequence's full blocks known so far (tokens
    # only grow, so they stay true), how many of block_ids are registered or were found in
    # the cache, and the prompt tokens the cache supplied at the first admission (usage)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_token: bool = False  # its last token is the EOS or stop token that ended it
    error: str = ""  # why, when finish_reason is "error"
    error_code: ErrorCode = ErrorCode.NONE
    num_preemptions: int = 0
    first_scheduled_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_positions_to_score(self) -> range:
        """Prompt positions whose next token still needs its log-probability (none unless
        the request asked for prompt logprobs)."""
        if self.sampling.prompt_logprobs is None:
            return range(0)
        return range(len(self.prompt_logprobs), self.num_prompt_tokens - 1)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
