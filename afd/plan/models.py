"""What the cost model needs to know about a model: its shapes, nothing about weights or names.

`ModelConfig` describes what afd can *serve*; `ModelArith` describes what the planner can *cost*,
which includes MLA (DeepSeek-V3) before afd serves it. Presets are the public configs of the
paper's models and a few others, transcribed value by value from their Hugging Face config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from afd.config import ModelConfig
from afd.plan.errors import PlanError

ATTENTION_KINDS = ("gqa", "mfa", "mla", "dsa")
LATENT_KINDS = ("mla", "dsa")  # a shared latent row per token instead of K/V heads


@dataclass(frozen=True)
class ModelArith:
    """Cost-relevant shapes of one MoE decoder (every layer has the same attention)."""

    name: str
    attention: str  # "gqa" | "mfa" | "mla" | "dsa" (MLA reading index_topk tokens)
    hidden_size: int
    num_layers: int
    moe_layers: int  # how many of num_layers are MoE; the rest are dense MLP layers
    num_heads: int
    num_kv_heads: int  # GQA/MFA K/V heads (MFA: 1); MLA: unused (the latent is shared)
    head_dim: int  # GQA/MFA head width; MLA: unused (see qk_nope/qk_rope/v_head dims)
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int
    shared_expert_intermediate_size: int = 0  # summed over all shared experts; 0 = none
    dense_intermediate_size: int = 0  # MLP width of the dense layers
    q_lora_rank: int = 0  # MFA share_q_dim / MLA q_lora_rank; 0 = full-rank query projection
    kv_lora_rank: int = 0  # MLA only
    qk_nope_dim: int = 0  # MLA only
    qk_rope_dim: int = 0  # MLA only
    v_head_dim: int = 0  # MLA only
    index_n_heads: int = 0  # DSA only: the lightning indexer's heads
    index_head_dim: int = 0  # DSA only
    index_topk: int = 0  # DSA only: tokens each query attends to
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise PlanError(
                f"model {self.name!r}: attention {self.attention!r} is not one of "
                f"{', '.join(ATTENTION_KINDS)}"
            )
        for f in ("hidden_size", "num_layers", "num_heads", "vocab_size"):
            if getattr(self, f) <= 0:
                raise PlanError(f"model {self.name!r}: {f} must be positive")
        if not 0 <= self.moe_layers <= self.num_layers:
            raise PlanError(f"model {self.name!r}: moe_layers must be within 0..num_layers")
        if self.moe_layers and not (0 < self.top_k <= self.num_experts):
            raise PlanError(f"model {self.name!r}: need 0 < top_k <= num_experts")
        if self.moe_layers and self.moe_intermediate_size <= 0:
            raise PlanError(f"model {self.name!r}: moe_intermediate_size must be positive")
        if self.dense_layers and self.dense_intermediate_size <= 0:
            raise PlanError(
                f"model {self.name!r}: {self.dense_layers} dense layers need a dense "
                "intermediate size"
            )
        latent = self.attention in LATENT_KINDS
        if latent and (self.kv_lora_rank <= 0 or self.v_head_dim <= 0):
            raise PlanError(f"model {self.name!r}: MLA needs kv_lora_rank and v_head_dim")
        if (
            self.attention == "dsa"
            and min(self.index_n_heads, self.index_head_dim, self.index_topk) <= 0
        ):
            raise PlanError(f"model {self.name!r}: DSA needs the indexer's heads, width, top-k")
        if not latent and (self.head_dim <= 0 or self.num_kv_heads <= 0):
            raise PlanError(f"model {self.name!r}: {self.attention} needs head_dim, num_kv_heads")

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers


def from_model_config(cfg: ModelConfig, name: str = "") -> ModelArith:
    """Any model afd serves as planner arithmetic."""
    if len(cfg.moe_layers) != cfg.num_layers:
        raise PlanError(f"model config lists {len(cfg.moe_layers)} moe_layers for {cfg.num_layers}")
    latent: dict = {}
    if cfg.mla is not None:
        m = cfg.mla
        latent = dict(
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_dim=m.qk_nope_head_dim,
            qk_rope_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim,
        )
    if cfg.indexer is not None:
        ix = cfg.indexer
        latent |= dict(index_n_heads=ix.n_heads, index_head_dim=ix.head_dim, index_topk=ix.topk)
    return ModelArith(
        name=name or Path(cfg.path).name or cfg.model_type,
        attention=cfg.attention,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        moe_layers=sum(cfg.moe_layers),
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        moe_intermediate_size=cfg.moe_intermediate_size,
        vocab_size=cfg.vocab_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        dense_intermediate_size=cfg.intermediate_size,
        q_lora_rank=cfg.q_lora_dim,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **latent,
    )


# Public config.json values (Hugging Face). Step-3: stepfun-ai/step3 (text part; layers 0-3 and
# 60 dense). DeepSeek-V3: first_k_dense_replace 3, 1 shared expert; V3.2 adds its indexer (64
# heads of 128, top 2048 tokens). Qwen3 MoE: every layer MoE.
PRESETS: dict[str, ModelArith] = {
    m.name: m
    for m in (
        ModelArith(
            name="step3", attention="mfa", hidden_size=7168, num_layers=61, moe_layers=56,
            num_heads=64, num_kv_heads=1, head_dim=256, q_lora_rank=2048,
            num_experts=48, top_k=3, moe_intermediate_size=5120,
            shared_expert_intermediate_size=5120, dense_intermediate_size=18432,
            vocab_size=128815,
        ),
        ModelArith(
            name="deepseek-v3", attention="mla", hidden_size=7168, num_layers=61, moe_layers=58,
            num_heads=128, num_kv_heads=0, head_dim=0, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
            num_experts=256, top_k=8, moe_intermediate_size=2048,
            shared_expert_intermediate_size=2048, dense_intermediate_size=18432,
            vocab_size=129280,
        ),
        ModelArith(
            name="deepseek-v3.2", attention="dsa", hidden_size=7168, num_layers=61,
            moe_layers=58, num_heads=128, num_kv_heads=0, head_dim=0, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
            index_n_heads=64, index_head_dim=128, index_topk=2048,
            num_experts=256, top_k=8, moe_intermediate_size=2048,
            shared_expert_intermediate_size=2048, dense_intermediate_size=18432,
            vocab_size=129280,
        ),
        ModelArith(
            name="qwen3-235b-a22b", attention="gqa", hidden_size=4096, num_layers=94,
            moe_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
            num_experts=128, top_k=8, moe_intermediate_size=1536, vocab_size=151936,
        ),
        ModelArith(
            name="qwen3-30b-a3b", attention="gqa", hidden_size=2048, num_layers=48,
            moe_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
            num_experts=128, top_k=8, moe_intermediate_size=768, vocab_size=151936,
        ),
        ModelArith(
            name="mixtral-8x7b", attention="gqa", hidden_size=4096, num_layers=32,
            moe_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
            num_experts=8, top_k=2, moe_intermediate_size=14336, vocab_size=32000,
        ),
    )
}  # fmt: skip

ALIASES = {
    "step-3": "step3",
    "dsv3": "deepseek-v3",
    "deepseek-r1": "deepseek-v3",  # same architecture
    "dsv32": "deepseek-v3.2",
    "deepseek-v32": "deepseek-v3.2",
    "qwen3-moe": "qwen3-235b-a22b",
    "qwen3-235b": "qwen3-235b-a22b",
    "qwen3-30b": "qwen3-30b-a3b",
    "mixtral": "mixtral-8x7b",
}


def resolve_model(spec: str) -> ModelArith:
    """A preset name (or alias) or a local Hugging Face checkpoint directory."""
    key = spec.strip().lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    if Path(spec).is_dir():
        return from_model_config(ModelConfig.from_hf(spec))
    raise PlanError(
        f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) "
        "nor a checkpoint directory with a config.json"
    )
