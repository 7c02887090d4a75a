"""Qwen3-MoE: GQA with an RMSNorm over each q and k head, softmax top-k routing, and dense MLP
layers where `mlp_only_layers` or `decoder_sparse_step` say so."""

from __future__ import annotations

from afd.config import ModelConfig
from afd.families.base import Family, register
from afd.families.fields import Fields
from afd.families.names import NORMS, WeightNames


def parse(f: Fields, path: str, prefix: str) -> ModelConfig:
    n = f.int("num_hidden_layers")
    mlp_only = set(f.raw.get("mlp_only_layers") or [])
    step = f.int("decoder_sparse_step", default=1)
    experts = f.int("num_experts", "num_local_experts")
    moe = tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(n))
    return ModelConfig(
        **f.common(path, prefix),
        num_kv_heads=f.int("num_key_value_heads"),
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


WEIGHTS = WeightNames(
    layer={
        **NORMS,
        **{f"self_attn.{p}": p for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        "self_attn.q_norm": "q_norm",
        "self_attn.k_norm": "k_norm",
        "mlp.gate": "router",
    },
    mlps={"mlp": "mlp"},  # the dense layers
    experts=("mlp.experts",),
)

FAMILY = register(
    Family(
        model_type="qwen3_moe",
        parse=parse,
        weights=WEIGHTS,
        attention="gqa",
        router="softmax_topk",
        ffn="swiglu",
    )
)
