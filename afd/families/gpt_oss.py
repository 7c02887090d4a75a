"""gpt-oss: GQA with biases, a learned sink logit per head, sliding-window layers alternating
with full ones, YaRN; top-k routing with a softmax over the chosen logits; experts with biases
and a clamped SwiGLU, stored as MXFP4 in the released checkpoints."""

from __future__ import annotations

from afd.config import ModelConfig
from afd.families.base import Family, register
from afd.families.fields import Fields
from afd.families.names import NORMS, WeightNames

_KINDS = ("sliding_attention", "full_attention")


def sliding_layers(f: Fields) -> tuple[bool, ...]:
    n = f.int("num_hidden_layers")
    kinds = f.raw.get("layer_types")
    if kinds is None:  # as transformers defaults it: sliding first, then alternating
        return tuple(i % 2 == 0 for i in range(n))
    if len(kinds) != n or any(k not in _KINDS for k in kinds):
        raise ValueError(f"layer_types must list {n} of {_KINDS}, got {kinds!r}")
    return tuple(k == "sliding_attention" for k in kinds)


def parse(f: Fields, path: str, prefix: str) -> ModelConfig:
    n = f.int("num_hidden_layers")
    sliding = sliding_layers(f)
    return ModelConfig(
        **f.common(path, prefix),
        num_kv_heads=f.int("num_key_value_heads"),
        q_lora_dim=0,
        qk_norm=False,
        rope_theta=f.rope_theta(150000.0),
        max_position=f.int("max_position_embeddings"),
        num_experts=f.int("num_local_experts", "num_experts"),
        top_k=f.int("num_experts_per_tok", "experts_per_token"),
        moe_intermediate_size=f.int("intermediate_size"),
        intermediate_size=0,
        shared_expert_intermediate_size=0,
        norm_topk_prob=False,  # the softmax over the chosen logits sums to one already
        moe_layers=(True,) * n,
        attention_bias=bool(f.raw.get("attention_bias", True)),
        attention_sinks=True,
        sliding_window=f.int("sliding_window", default=0) if any(sliding) else 0,
        sliding_layers=sliding,
        expert_bias=True,
        swiglu_limit=f.float("swiglu_limit", 7.0),
        swiglu_alpha=f.float("swiglu_alpha", 1.702),
        chat_format="harmony",
    )


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

WEIGHTS = WeightNames(
    layer={
        **NORMS,
        **{f"self_attn.{p}": p for p in _ATTN},
        **{f"self_attn.{p}.bias": f"{p}_bias" for p in _ATTN},
        "self_attn.sinks": "sinks",
        "mlp.router": "router",
        "mlp.router.bias": "router_bias",
    },
    # one tensor per projection for every expert, [E, in, out]; gate and up interleaved by row
    projections={"gate_up_proj": "gate_up", "down_proj": "down"},
    stacked="mlp.experts",
    stacked_transposed=True,
)

FAMILY = register(
    Family(
        model_type="gpt_oss",
        parse=parse,
        weights=WEIGHTS,
        attention="gqa",
        router="topk_softmax",
        ffn="swiglu_clamped",
    )
)
