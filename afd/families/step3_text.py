"""Step-3 (text): MFA attention (a low-rank query, one shared K/V head), softmax top-k routing
plus a shared expert, dense MLP layers outside `moe_layers_enum`, and every layer's experts
stacked in one [E, ...] tensor per projection."""

from __future__ import annotations

from afd.config import ModelConfig
from afd.families.base import Family, register
from afd.families.fields import Fields
from afd.families.names import NORMS, WeightNames


def parse(f: Fields, path: str, prefix: str) -> ModelConfig:
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


WEIGHTS = WeightNames(
    layer={
        **NORMS,
        # MFA: q_proj is the low-rank down-projection [q_lora_dim, H], wq the up-projection
        **{f"self_attn.{p}": p for p in ("q_proj", "k_proj", "v_proj", "o_proj", "wq")},
        "self_attn.inter_norm": "inter_norm",
        "moe.gate": "router",
    },
    mlps={"mlp": "mlp", "share_expert": "shared"},
    stacked="moe",  # moe.{gate,up,down}_proj, each [E, out, in]
)

FAMILY = register(
    Family(
        model_type="step3_text",
        parse=parse,
        weights=WEIGHTS,
        attention="mfa",
        router="softmax_topk",
        ffn="swiglu",
    )
)
