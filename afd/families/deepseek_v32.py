"""DeepSeek-V3.2: DeepSeek-V3 whose attention reads, per query, only the `index_topk` earlier
tokens that a lightning indexer selects (DeepSeek Sparse Attention)."""

from __future__ import annotations

from afd.config import IndexerDims, ModelConfig
from afd.families import deepseek_v3
from afd.families.base import Family, register
from afd.families.fields import Fields
from afd.families.names import WeightNames


def parse(f: Fields, path: str, prefix: str) -> ModelConfig:
    indexer = IndexerDims(
        n_heads=f.int("index_n_heads"),
        head_dim=f.int("index_head_dim"),
        topk=f.int("index_topk"),
    )
    if indexer.head_dim < f.int("qk_rope_head_dim"):
        raise ValueError("index_head_dim is narrower than qk_rope_head_dim")
    return ModelConfig(**deepseek_v3.fields(f, path, prefix), indexer=indexer)


WEIGHTS = WeightNames(
    layer={
        **deepseek_v3.WEIGHTS.layer,
        "self_attn.indexer.wq_b": "index_wq",
        "self_attn.indexer.wk": "index_wk",
        "self_attn.indexer.k_norm": "index_k_norm",
        "self_attn.indexer.k_norm.bias": "index_k_norm_bias",
        "self_attn.indexer.weights_proj": "index_weights",
    },
    mlps=deepseek_v3.WEIGHTS.mlps,
    experts=deepseek_v3.WEIGHTS.experts,
)

FAMILY = register(
    Family(
        model_type="deepseek_v32",
        parse=parse,
        weights=WEIGHTS,
        attention="dsa",
        router="sigmoid_group_topk",
        ffn="swiglu",
    )
)
