"""Frozen configuration dataclasses.

`ModelConfig` is the one normalised description of a model that everything in afd and the
services reads. Hugging Face field names are known only to each family's parser
(afd/families), which `ModelConfig.from_hf` picks by `model_type`; what differs between
families reaches the services as the kind names it fills (attention, router, ffn), so no
service keys anything by `model_type`. Derived values use `dataclasses.replace`, never mutation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd.errors import ConfigError
from afd.security import Security


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention (DeepSeek): a low-rank query and one compressed latent per
    token, from which every head's key and value are projected."""

    kv_lora_rank: int  # the latent a token leaves in the KV cache
    q_lora_rank: int  # rank of the low-rank query; 0: a full q_proj
    qk_nope_head_dim: int  # per-head key/query width without position
    qk_rope_head_dim: int  # the rotary part, one key shared by every head
    v_head_dim: int
    # DeepSeek's checkpoints order the rotary dims in (x0, x1) pairs; the loader permutes the
    # projections' rows so that the half-split rotation computes the same thing
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        check(
            min(self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim) >= 1
            and self.qk_nope_head_dim >= 0
            and self.q_lora_rank >= 0,
            f"MLA dimensions must be positive, got {self}",
        )
        check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class IndexerDims:
    """DeepSeek Sparse Attention's lightning indexer: per query, the `topk` earlier tokens
    that the attention reads, scored by `n_heads` small ReLU heads of width `head_dim`."""

    n_heads: int
    head_dim: int
    topk: int

    def __post_init__(self) -> None:
        check(
            min(self.n_heads, self.head_dim, self.topk) >= 1,
            f"indexer dimensions must be >= 1, got {self}",
        )


@dataclass(frozen=True)
class RopeScaling:
    """YaRN context extension (the only RoPE scaling afd applies), as transformers reads it."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # scales cos/sin; None: derived from the mscales
    truncate: bool = True

    def __post_init__(self) -> None:
        check(self.factor > 0, f"rope scaling factor must be > 0, got {self.factor}")
        check(
            self.original_max_position >= 1,
            f"original_max_position_embeddings must be >= 1, got {self.original_max_position}",
        )


@dataclass(frozen=True)
class ModelConfig:
    """One generic MoE decoder; every family is a set of values for these fields."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # The kinds each service builds its layers from, named by the family (afd/families):
    # "gqa" (q/k/v projections, optional q/k RMSNorm), "mfa" (low-rank query, shared K/V head),
    # "mla" (latent KV, `mla` below) or "dsa" (MLA reading the tokens `indexer` selects)
    attention: str
    router: str  # a key of services/attention/moe_router.py's ROUTERS
    # a key of services/ffn/kinds.py's FFN_KINDS: "swiglu", or "swiglu_clamped" (gpt-oss)
    ffn: str
    q_lora_dim: int  # MFA only: rank of the low-rank query (Step-3 `share_q_dim`)
    qk_norm: bool
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # dense-layer MLP width
    shared_expert_intermediate_size: int  # 0: no shared expert
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # moe_layers[i]: layer i is MoE (else dense MLP)
    tie_word_embeddings: bool = False
    # (rows, columns) of a block-FP8 checkpoint's scale blocks; None: weights are not FP8
    weight_block: tuple[int, int] | None = None
    mla: MLADims | None = None  # attention "mla" and "dsa" only
    indexer: IndexerDims | None = None  # attention "dsa" only
    rope_scaling: RopeScaling | None = None
    # Group-limited routing (DeepSeek): experts in n_group groups, the top topk_group groups
    # chosen first; the chosen weights are multiplied by routed_scaling_factor.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # gpt-oss: biases on q/k/v/o, a learned sink logit per head in every softmax, and
    # `sliding_window` keys (0: none) on the layers `sliding_layers` marks (empty: none)
    attention_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    # gpt-oss experts: biases on gate/up/down; the "swiglu_clamped" FFN kind's gate limit and
    # sigmoid gain
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # routed experts stored as MXFP4 (`*_blocks` e2m1 pairs, `*_scales` e8m0 per 32 values)
    mxfp4_experts: bool = False
    chat_format: str = "text"  # its chat answers: text, or harmony (gpt-oss: gateway/harmony.py)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    weight_prefix: str = ""  # e.g. "language_model." in a vision-language checkpoint
    path: str = ""

    def __post_init__(self) -> None:
        check(
            (self.attention in ("mla", "dsa")) == (self.mla is not None),
            f"attention {self.attention!r} and MLA dimensions go together",
        )
        check(
            (self.attention == "dsa") == (self.indexer is not None),
            f"attention {self.attention!r} and indexer dimensions go together",
        )
        check(
            self.indexer is None or self.mla is None or self.mla.q_lora_rank > 0,
            "sparse attention's indexer reads the query latent: q_lora_rank must be set",
        )
        check(
            self.n_group >= 1 and 1 <= self.topk_group <= self.n_group,
            f"topk_group must be in 1..n_group, got {self.topk_group} of {self.n_group}",
        )
        check(
            self.num_experts % self.n_group == 0,
            f"{self.num_experts} experts do not split into {self.n_group} groups",
        )

        check(
            not self.sliding_layers or len(self.sliding_layers) == self.num_layers,
            f"sliding_layers names {len(self.sliding_layers)} layers, not {self.num_layers}",
        )
        check(
            self.sliding_window >= 0 and (self.sliding_window > 0 or not any(self.sliding_layers)),
            f"sliding layers need a sliding window >= 1, got {self.sliding_window}",
        )
        check(
            self.chat_format in ("text", "harmony"),
            f"chat_format must be text or harmony, not {self.chat_format!r}",
        )

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer]

    def window(self, layer: int) -> int:
        """Keys a query of `layer` sees, itself included (0: all before it)."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ModelConfig:
        """Read `config.json` of a local Hugging Face checkpoint directory."""
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory {str(path)!r} does not exist or is not a directory")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{str(path)!r} has no config.json: is it a Hugging Face checkpoint?")
        try:
            raw = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{cfg_file} must hold a JSON object")
        return cls.from_dict(raw, path=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str = "") -> ModelConfig:
        """Parse a config.json dict with its family's parser (afd/families)."""
        from afd.families import Fields, family  # imported here: the families import this module

        prefix = ""
        if "text_config" in raw and "model_type" not in raw.get("text_config", {}):
            raise ConfigError("config.json has a text_config without a model_type")
        if "text_config" in raw:  # vision-language wrapper: serve its text model
            raw = {**raw["text_config"]}
            prefix = "language_model."
        mt = raw.get("model_type")
        fam = family(mt)  # ConfigError naming the supported model types
        try:
            return fam.parse(Fields(raw, fam), path, prefix)
        except KeyError as e:
            raise ConfigError(f"config.json ({mt}) is missing required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json ({mt}) has a malformed field: {e}") from e


def check(ok: bool, problem: str) -> None:
    """A config dataclass's own validation: one ConfigError naming the bad value."""
    if not ok:
        raise ConfigError(problem)


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


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests in one step, at most
    max_num_batched_tokens: int = 2048  # tokens in one step, at most
    max_model_len: int = 0  # 0: the model's max_position
    enable_chunked_prefill: bool = True
    # Backpressure: past either bound a new request is refused as overloaded (HTTP 429).
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20  # prompt tokens waiting in total

    def __post_init__(self) -> None:
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
