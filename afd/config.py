"""Frozen configuration dataclasses: how a model is served (the KV cache, the scheduler, MXFP4
experts, the engine), each validating itself. The model's own description, `ModelConfig`, is
in afd/model_config.py and is imported from here as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from afd.errors import ConfigError, check
from afd.model_config import IndexerDims, MLADims, ModelConfig, RopeScaling
from afd.security import Security

__all__ = [
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "ExpertConfig",
    "IndexerDims",
    "MLADims",
    "ModelConfig",
    "RopeScaling",
    "SchedulerConfig",
    "SpeculativeConfig",
    "check",
    "check_device",
]


# where a role computes (afd/device.py resolves it on the host): auto, cpu, cuda, cuda:N
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(spec: str) -> None:
    """Raises ConfigError unless `spec` names a device kind afd knows (not that it is there)."""
    check(bool(_DEVICE.fullmatch(spec)), f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")


COMPUTE_DTYPES = ("bfloat16", "float32")
WIRE_DTYPES = ("fp8", "bf16", "fp32")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # 0: size the pool from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # memory for the KV pool
    # reuse the K/V of full blocks whose prefix an earlier request computed (afd.prefix)
    enable_prefix_caching: bool = True
    # On a CUDA device: the share of its memory this process may hold; the KV pool takes what
    # weights and activations leave of it (kv_cache_memory_gb is the CPU's budget).
    gpu_memory_utilization: float = 0.9
    # what K and V are stored as: auto (the compute dtype) or fp8 (e4m3 with a float32 scale
    # per token and head: about half of bf16's bytes, read back as the compute dtype)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check(self.block_size >= 1, f"block size must be >= 1, got {self.block_size}")
        check(self.num_blocks >= 0, f"num_blocks must be >= 0, got {self.num_blocks}")
        check(
            self.kv_cache_memory_gb > 0, f"KV cache GB must be > 0, got {self.kv_cache_memory_gb}"
        )
        check(
            self.kv_cache_dtype in ("auto", "fp8"),
            f"the KV cache dtype must be auto or fp8, got {self.kv_cache_dtype!r}",
        )
        check(
            0 < self.gpu_memory_utilization <= 1,
            f"GPU memory utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests in one step, at most
    max_num_batched_tokens: int = 2048  # tokens in one step, at most
    max_model_len: int = 0  # 0: the model's max_position
    enable_chunked_prefill: bool = True
    # Backpressure: past either bound a new request is refused as overloaded (HTTP 429).
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20  # prompt tokens waiting in total
    # vLLM's scheduling policies: fcfs (arrival order), or priority (a request's `priority`,
    # lower first; services/attention/waiting.py)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        check(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling policy must be one of {SCHEDULING_POLICIES}, "
            f"got {self.scheduling_policy!r}",
        )
        check(
            self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1,
            "max_num_seqs and max_num_batched_tokens must be >= 1, got "
            f"{self.max_num_seqs} and {self.max_num_batched_tokens}",
        )
        check(self.max_model_len >= 0, f"max_model_len must be >= 0, got {self.max_model_len}")
        check(
            self.max_waiting_requests >= 0 and self.max_waiting_tokens >= 0,
            "max_waiting_requests and max_waiting_tokens must be >= 0",
        )


EXPERT_COMPUTE = ("auto", "direct", "workspace")


@dataclass(frozen=True)
class ExpertConfig:
    """How an FFN server multiplies MXFP4 experts (others are multiplied as stored).

    direct: afd's kernel reads the 4-bit weights in every matmul; workspace: experts are
    converted on use into a shared pool of `workspace_mb` MiB (least recently used out) and
    multiplied on the dense path; auto: this CPU's default (services/ffn/engine.py).
    """

    compute: str = "auto"
    workspace_mb: float = 1024.0

    def __post_init__(self) -> None:
        check(
            self.compute in EXPERT_COMPUTE,
            f"expert compute must be one of {EXPERT_COMPUTE}, got {self.compute!r}",
        )
        check(self.workspace_mb >= 0, f"workspace MiB must be >= 0, got {self.workspace_mb}")


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `--speculative-config` vocabulary. `ngram` (prompt lookup)
    drafts the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from prompt_lookup_max down to prompt_lookup_min); one step then computes the last token
    and the drafts together and keeps the drafts as the request's own sampling would have
    chosen them (services/attention/speculative.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts per request and step, at most
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # no drafts in a step that runs more requests than this (0: never off): a large batch is
    # bound by compute, where a rejected draft costs what it cannot save
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        check(
            self.method in SPECULATIVE_METHODS,
            f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
        )
        check(
            self.num_speculative_tokens >= 1,
            f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}",
        )
        check(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
            f"{self.prompt_lookup_min} and {self.prompt_lookup_max}",
        )
        check(
            self.disable_by_batch_size >= 0,
            f"disable_by_batch_size must be >= 0, got {self.disable_by_batch_size}",
        )

    @classmethod
    def from_dict(cls, given: dict) -> SpeculativeConfig:
        """From `--speculative-config`'s JSON object; an unknown key is an error that names it
        (vLLM's draft-model keys among them: afd drafts by n-gram lookup only)."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(given) - known)
        check(
            not unknown,
            f"unknown speculative-config key(s) {unknown}; afd takes {sorted(known)}",
        )
        for k, v in given.items():
            want = str if k == "method" else int
            check(
                isinstance(v, want) and not isinstance(v, bool),
                f"speculative-config {k} must be {want.__name__}, got {v!r}",
            )
        given = dict(given)
        if "prompt_lookup_min" not in given and "prompt_lookup_max" in given:
            # a maximum below the default minimum lowers the minimum with it (not an error)
            given["prompt_lookup_min"] = min(cls.prompt_lookup_min, given["prompt_lookup_max"])
        return cls(**given)


@dataclass(frozen=True)
class EngineConfig:
    """What an attention-side engine needs; built once from CLI flags or a test."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "bfloat16"  # compute dtype: bfloat16 | float32
    # weights, KV cache and compute: auto | cpu | cuda | cuda:N (afd/device.py)
    device: str = "auto"
    # the in-process FFN shards' (afd generate, afd serve --transport inproc); "": `device`
    ffn_device: str = ""
    threads: int = 0  # torch threads; 0: leave torch's default
    # S micro-batches in flight per step (1: serial). S >= 2 overlaps attention and FFN, which
    # pays when the FFN side is compute-bound (large batches).
    micro_batches: int = 1
    # A decode step's layers in one native call where attention and the one expert shard share
    # this process (services/attention/stack.py); False: the layer loop (the same bits).
    decode_stack: bool = True
    # Up to this many decode steps in that one call, each from the tokens the last one chose,
    # where a step's every request may take them (services/attention/burst.py); 1: one step
    num_scheduler_steps: int = 4
    a2f_dtype: str = "fp8"  # hidden states on the wire attention -> FFN: fp8 | bf16 | fp32
    # The i-th entry serves expert shard i; "a|b" names replicas of one shard (failover).
    ffn_addresses: tuple[str, ...] = ("inproc://ffn0",)
    ffn_timeout_s: float = 30.0  # deadline of one FFN call
    ffn_failover_s: float = 0.0  # one replica's time to answer before failover; 0: timeout/replicas
    # How long requests wait, paused with their KV cache, for an expert shard that lost its last
    # replica to come back before they fail; 0: fail at once.
    ffn_grace_s: float = 20.0
    security: Security = field(default_factory=Security)  # data-plane CURVE / TLS
    experts: ExpertConfig = field(default_factory=ExpertConfig)  # in-process FFN shards
    # An elastic FFN pool instead of fixed shards (ffn_addresses unused): "file:PATH" or
    # "dns:SCHEME://NAME:PORT" (services/attention/pool_source.py), read every interval.
    ffn_pool: str = ""
    ffn_pool_interval_s: float = 1.0
    # elastic pool: the heaviest experts of each layer are computed by two members
    hot_expert_replicas: int = 0
    speculative: SpeculativeConfig | None = None  # None: one token per request and step
    sampling_seed: int = -1  # the global generator's seed at start (unseeded requests); -1: none

    def __post_init__(self) -> None:
        check(
            self.dtype in COMPUTE_DTYPES,
            f"dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}",
        )
        check_device(self.device)
        if self.ffn_device:
            check_device(self.ffn_device)
        check(self.threads >= 0, f"threads must be >= 0, got {self.threads}")
        check(self.micro_batches >= 1, f"micro-batches must be >= 1, got {self.micro_batches}")
        check(
            self.num_scheduler_steps >= 1,
            f"scheduler steps must be >= 1, got {self.num_scheduler_steps}",
        )
        check(
            self.a2f_dtype in WIRE_DTYPES,
            f"the a2f dtype must be one of {WIRE_DTYPES}, got {self.a2f_dtype!r}",
        )
        check(bool(self.ffn_addresses), "at least one FFN address is needed")
        for entry in self.ffn_addresses:
            check(
                all(a.strip() for a in entry.split("|")),
                f"FFN address {entry!r} has an empty replica address",
            )
        check(self.ffn_timeout_s > 0, f"the FFN timeout must be > 0, got {self.ffn_timeout_s}")
        check(
            self.ffn_failover_s >= 0,
            f"the failover timeout must be >= 0, got {self.ffn_failover_s}",
        )
        check(self.ffn_grace_s >= 0, f"the FFN grace period must be >= 0, got {self.ffn_grace_s}")
        check(
            self.ffn_pool_interval_s > 0,
            f"the FFN pool interval must be > 0, got {self.ffn_pool_interval_s}",
        )
        check(
            self.hot_expert_replicas >= 0,
            f"hot expert replicas must be >= 0, got {self.hot_expert_replicas}",
        )
