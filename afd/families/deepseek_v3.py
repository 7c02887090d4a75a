"""DeepSeek-V3: multi-head latent attention (a compressed KV latent per token, a low-rank
query), sigmoid routing limited to the best expert groups with a selection-only bias, a shared
expert, and dense MLP layers before `first_k_dense_replace`."""

from __future__ import annotations

from typing import Any

from afd.config import MLADims, ModelConfig
from afd.families.base import Family, register
from afd.families.fields import Fields
from afd.families.names import NORMS, WeightNames


def mla_dims(f: Fields) -> MLADims:
    return MLADims(
        kv_lora_rank=f.int("kv_lora_rank"),
        q_lora_rank=f.int("q_lora_rank", default=0),
        qk_nope_head_dim=f.int("qk_nope_head_dim"),
        qk_rope_head_dim=f.int("qk_rope_head_dim"),
        v_head_dim=f.int("v_head_dim"),
        rope_interleave=bool(f.raw.get("rope_interleave", True)),
    )


def moe_layers(f: Fields, experts: int) -> tuple[bool, ...]:
    n = f.int("num_hidden_layers")
    kinds = f.raw.get("mlp_layer_types")  # V3.2 may list them instead
    if isinstance(kinds, list):
        if len(kinds) != n:
            raise ValueError(f"mlp_layer_types lists {len(kinds)} layers, not {n}")
        return tuple(experts > 0 and k == "sparse" for k in kinds)
    dense = f.int("first_k_dense_replace", default=0)
    return tuple(experts > 0 and i >= dense for i in range(n))


def fields(f: Fields, path: str, prefix: str) -> dict[str, Any]:
    """Every ModelConfig field of a DeepSeek-V3-like config (V3.2 adds its indexer)."""
    experts = f.int("n_routed_experts", "num_local_experts")
    mla = mla_dims(f)
    common = f.common(path, prefix)
    # the softmax scale's width; config.json's own head_dim is the rotary part's
    common["head_dim"] = mla.qk_head_dim
    return dict(
        **common,
        num_kv_heads=1,  # one latent per token, shared by every head
        q_lora_dim=mla.q_lora_rank,
        qk_norm=False,
        mla=mla,
        rope_theta=f.rope_theta(10000.0),
        max_position=f.int("max_position_embeddings"),
        num_experts=experts,
        top_k=f.int("num_experts_per_tok"),
        moe_intermediate_size=f.int("moe_intermediate_size"),
        intermediate_size=f.int("intermediate_size"),
        shared_expert_intermediate_size=(
            f.int("moe_intermediate_size") * f.int("n_shared_experts", default=0)
        ),
        norm_topk_prob=bool(f.raw.get("norm_topk_prob", True)),
        n_group=f.int("n_group", default=1),
        topk_group=f.int("topk_group", default=1),
        routed_scaling_factor=f.float("routed_scaling_factor", 1.0),
        moe_layers=moe_layers(f, experts),
    )


def parse(f: Fields, path: str, prefix: str) -> ModelConfig:
    return ModelConfig(**fields(f, path, prefix))


WEIGHTS = WeightNames(
    layer={
        **NORMS,
        **{f"self_attn.{p}": p for p in ("q_proj", "q_a_proj", "q_b_proj", "kv_b_proj", "o_proj")},
        "self_attn.kv_a_proj_with_mqa": "kv_a_proj",
        "self_attn.q_a_layernorm": "q_a_norm",
        "self_attn.kv_a_layernorm": "kv_a_norm",
        "mlp.gate": "router",
        "mlp.gate.e_score_correction_bias": "router_bias",
    },
    mlps={"mlp": "mlp", "mlp.shared_experts": "shared"},
    experts=("mlp.experts",),
)

FAMILY = register(
    Family(
        model_type="deepseek_v3",
        parse=parse,
        weights=WEIGHTS,
        attention="mla",
        router="sigmoid_group_topk",
        ffn="swiglu",
    )
)
