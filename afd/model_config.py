"""The one normalised description of a model that everything in afd and the services reads
(`ModelConfig`, with its attention kinds' dimensions and RoPE scaling), frozen.

Hugging Face field names are known only to each family's parser (afd/families), which
`ModelConfig.from_hf` picks by `model_type`; what differs between families reaches the services
as the kind names it fills (attention, router, ffn), so no service keys anything by
`model_type`. Derived values use `dataclasses.replace`, never mutation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from afd.errors import ConfigError, check


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
    # the matmul weights quantized to block-FP8 in weight_block's blocks as they load, from a
    # checkpoint that holds them in 16 or 32 bits (with_quantization: vLLM's --quantization)
    quantize_on_load: bool = False
    # the LM head in block-FP8 too (quantized as it loads), as llama.cpp's 8-bit files hold it;
    # vLLM's --quantization fp8 keeps it in 16 bits, and so does afd without this
    quantize_lm_head: bool = False
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
            not self.quantize_lm_head or self.weight_block is not None,
            "--quantize-lm-head needs block-FP8 weights: --quantization fp8 or an FP8 checkpoint",
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

    def with_quantization(self, method: str | None, lm_head: bool = False) -> ModelConfig:
        """This model with its matmul weights quantized as they load (`--quantization`, as
        vLLM names it): "fp8" is block-FP8 in DeepSeek's 128x128 blocks (afd's FP8 kernels'
        format; what `afd quantize --fp8-block` writes ahead of time). A block-FP8 checkpoint
        stays as it is; None changes nothing. lm_head (`--quantize-lm-head`): the LM head too,
        in the same blocks (which a block-FP8 checkpoint or method "fp8" must give)."""
        cfg = self
        if method is not None and self.weight_block is None:
            check(
                method == "fp8",
                f"--quantization {method!r}: afd quantizes weights to fp8 only (block-FP8)",
            )
            cfg = replace(self, weight_block=(128, 128), quantize_on_load=True)
        return replace(cfg, quantize_lm_head=True) if lm_head else cfg

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
