"""Mixtral: plain GQA, softmax top-k routing always renormalised, every layer MoE."""

from __future__ import annotations

from afd.config import ModelConfig
from afd.families.base import Family, register
from afd.families.fields import Fields
from afd.families.names import GATE_UP_DOWN, NORMS, WeightNames


def parse(f: Fields, path: str, prefix: str) -> ModelConfig:
    n = f.int("num_hidden_layers")
    return ModelConfig(
        **f.common(path, prefix),
        num_kv_heads=f.int("num_key_value_heads"),
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


# The original checkpoints say `block_sparse_moe` and w1/w3/w2; re-exports may use transformers'
# newer `mlp` and gate/up/down_proj spellings.
WEIGHTS = WeightNames(
    layer={
        **NORMS,
        **{f"self_attn.{p}": p for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        "block_sparse_moe.gate": "router",
        "mlp.gate": "router",
    },
    projections={"w1": "gate", "w3": "up", "w2": "down", **GATE_UP_DOWN},
    experts=("block_sparse_moe.experts", "mlp.experts"),
)

FAMILY = register(
    Family(
        model_type="mixtral",
        parse=parse,
        weights=WEIGHTS,
        attention="gqa",
        router="softmax_topk",
        ffn="swiglu",
    )
)
