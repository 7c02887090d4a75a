"""Frozen configuration dataclasses.

`ModelConfig.from_hf` is the only place in afd that knows Hugging Face field names: everything
else reads the normalised fields below. Derived values use `dataclasses.replace`, never mutation.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd.errors import ConfigError
from afd.security import Security

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral", "step3_text")


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
    # "gqa" (q/k/v projections, optional q/k RMSNorm) or "mfa" (low-rank query, shared K/V head)
    attention: str
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
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    weight_prefix: str = ""  # e.g. "language_model." in a vision-language checkpoint
    path: str = ""

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer]

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
        prefix = ""
        if "text_config" in raw and "model_type" not in raw.get("text_config", {}):
            raise ConfigError("config.json has a text_config without a model_type")
        if "text_config" in raw:  # vision-language wrapper: serve its text model
            raw = {**raw["text_config"]}
            prefix = "language_model."
        mt = raw.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {mt!r}; afd serves: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            return _PARSERS[mt](_Fields(raw, mt), path, prefix)
        except KeyError as e:
            raise ConfigError(f"config.json ({mt}) is missing required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json ({mt}) has a malformed field: {e}") from e


class _Fields:
    """Typed access to a raw config dict, with a clear error naming a missing field."""

    def __init__(self, raw: dict[str, Any], model_type: str):
        self.raw = raw
        self.model_type = model_type

    def int(self, *names: str, default: Any = dataclasses.MISSING) -> int:
        for n in names:
            if self.raw.get(n) is not None:
                return int(self.raw[n])
        if default is dataclasses.MISSING:
            raise KeyError(names[0])
        return default

    def float(self, name: str, default: float) -> float:
        v = self.raw.get(name)
        return float(default if v is None else v)

    def rope_theta(self, default: float) -> float:
        # transformers >= 5 nests it under rope_parameters; older configs keep it top-level
        params = self.raw.get("rope_parameters") or {}
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            return float(params["rope_theta"])
        scaling = self.raw.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (
            None,
            "default",
        ):
            raise ValueError(f"rope_scaling {scaling!r} is not supported yet")
        return self.float("rope_theta", default)

    def eos(self) -> tuple[int, ...]:
        v = self.raw.get("eos_token_id")
        if v is None:
            return ()
        return tuple(int(x) for x in (v if isinstance(v, list) else [v]))

    def common(self, path: str, prefix: str) -> dict[str, Any]:
        hidden = self.int("hidden_size")
        heads = self.int("num_attention_heads")
        return dict(
            model_type=self.model_type,
            vocab_size=self.int("vocab_size"),
            hidden_size=hidden,
            num_layers=self.int("num_hidden_layers"),
            num_heads=heads,
            head_dim=self.int("head_dim", default=hidden // heads),
            rms_norm_eps=self.float("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(self.raw.get("tie_word_embeddings", False)),
            eos_token_ids=self.eos(),
            bos_token_id=self.raw.get("bos_token_id"),
            torch_dtype=str(self.raw.get("dtype") or self.raw.get("torch_dtype") or "bfloat16"),
            weight_prefix=prefix,
            path=path,
        )


def _qwen3_moe(f: _Fields, path: str, prefix: str) -> ModelConfig:
    n = f.int("num_hidden_layers")
    mlp_only = set(f.raw.get("mlp_only_layers") or [])
    step = f.int("decoder_sparse_step", default=1)
    experts = f.int("num_experts", "num_local_experts")
    moe = tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(n))
    return ModelConfig(
        **f.common(path, prefix),
        num_kv_heads=f.int("num_key_value_heads"),
        attention="gqa",
        q_lora_dim=0,
        qk_norm=True,
        rope_theta=f.rope_theta(10000.0),
        max_position=f.int("max_position_embeddings"),
        num_experts=experts,
        top_k=f.int("num_experts_per_tok"),
        moe_intermediate_size=f.int("moe_intermediate_size"),
        intermediate_size=f.int("intermediate_size", default=0),
        shared_expert_intermediate_size=0,
        norm_topk_prob=bool(f.raw.get("norm_topk_prob", False)),
        moe_layers=moe,
    )


def _mixtral(f: _Fields, path: str, prefix: str) -> ModelConfig:
    n = f.int("num_hidden_layers")
    return ModelConfig(
        **f.common(path, prefix),
        num_kv_heads=f.int("num_key_value_heads"),
        attention="gqa",
        q_lora_dim=0,
        qk_norm=False,
        rope_theta=f.rope_theta(1e6),
        max_position=f.int("max_position_embeddings"),
        num_experts=f.int("num_local_experts", "num_experts"),
        top_k=f.int("num_experts_per_tok"),
        moe_intermediate_size=f.int("intermediate_size"),
        intermediate_size=0,
        shared_expert_intermediate_size=0,
        norm_topk_prob=True,  # Mixtral always renormalises its top-2
        moe_layers=(True,) * n,
    )


def _step3_text(f: _Fields, path: str, prefix: str) -> ModelConfig:
    n = f.int("num_hidden_layers")
    enum = f.raw.get("moe_layers_enum")
    if enum is None:
        moe_idx = set(range(1, n))
    elif isinstance(enum, str):
        moe_idx = {int(x) for x in enum.split(",") if x.strip()}
    else:
        moe_idx = {int(x) for x in enum}
    if any(i < 0 or i >= n for i in moe_idx):
        raise ValueError(f"moe_layers_enum names a layer outside 0..{n - 1}")
    return ModelConfig(
        **f.common(path, prefix),
        num_kv_heads=f.int("num_attention_groups", default=1),
        attention="mfa",
        q_lora_dim=f.int("share_q_dim"),
        qk_norm=False,
        rope_theta=f.rope_theta(500000.0),
        max_position=f.int("max_position_embedding", "max_position_embeddings", "max_seq_len"),
        num_experts=f.int("moe_num_experts", "num_experts", "num_local_experts"),
        top_k=f.int("moe_top_k", "num_experts_per_tok"),
        moe_intermediate_size=f.int("moe_intermediate_size"),
        intermediate_size=f.int("intermediate_size"),
        shared_expert_intermediate_size=f.int("share_expert_dim", default=0),
        norm_topk_prob=bool(f.raw.get("norm_expert_weight", False)),
        moe_layers=tuple(i in moe_idx for i in range(n)),
    )


_PARSERS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "step3_text": _step3_text}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0: size the pool from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the model's max_position
    enable_chunked_prefill: bool = True
    # Backpressure: past either bound a new request is refused as overloaded (HTTP 429).
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20  # prompt tokens waiting in total


@dataclass(frozen=True)
class EngineConfig:
    """What an attention-side engine needs; built once from CLI flags or a test."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "bfloat16"  # compute dtype: bfloat16 | float32
    micro_batches: int = 1
    a2f_dtype: str = "bf16"  # fp8 | bf16 | fp32 on the wire attention -> FFN
    # The i-th entry serves expert shard i; "a|b" names replicas of one shard (failover).
    ffn_addresses: tuple[str, ...] = ("inproc://ffn0",)
    ffn_timeout_s: float = 30.0
    ffn_failover_s: float = 0.0  # one replica's time to answer before failover; 0: timeout/replicas
    device: str = "cpu"
    threads: int = 0  # 0: leave torch's default
    security: Security = field(default_factory=Security)  # data-plane CURVE / TLS
