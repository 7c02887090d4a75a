"""Per-token decode arithmetic: FLOPs, KV bytes and parameters, per attention kind.

Everything here is for decoding ONE token at context length L (the token attends to L cached
positions), summed over all layers. A multiply-add counts as 2 FLOPs. Norm weights and the
softmax/RoPE element-wise work are left out: they are below 0.1% of any figure here.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd.plan.errors import PlanError
from afd.plan.models import ModelArith

# Bytes per cached K/V element (or per weight element) by dtype name.
DTYPE_BYTES = {"fp8": 1, "int8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise PlanError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def kv_elems_per_layer(m: ModelArith) -> int:
    """Cached elements per token per layer (what memory sizing needs); for dense attention
    also what one decode step reads per past position."""
    if m.attention == "dsa":  # the latent row, and the indexer's key beside it
        return m.kv_lora_rank + m.qk_rope_dim + m.index_head_dim
    if m.attention == "mla":
        return m.kv_lora_rank + m.qk_rope_dim  # one shared latent row (+ decoupled RoPE key)
    return 2 * m.num_kv_heads * m.head_dim  # K and V


def attended(m: ModelArith, context: int) -> int:
    """Positions the attention core reads for one query: all of them, or DSA's top-k."""
    return min(context, m.index_topk) if m.attention == "dsa" else context


def kv_read_elems(m: ModelArith, context: int) -> int:
    """Cache elements one decode step reads per layer at `context`: DSA's indexer reads every
    position's key, its attention only the selected latent rows."""
    if m.attention == "dsa":
        latent = m.kv_lora_rank + m.qk_rope_dim
        return attended(m, context) * latent + context * m.index_head_dim
    return context * kv_elems_per_layer(m)


def core_flops(m: ModelArith, context: int) -> int:
    """Attention-core FLOPs per layer for one query token at `context` (DSA: its indexer's
    scores over every position, plus the attention over the selected ones)."""
    flops = attended(m, context) * core_flops_per_position(m)
    if m.attention == "dsa":
        flops += context * 2 * m.index_n_heads * (m.index_head_dim + 1)  # q.k, then weights
    return flops


def core_flops_per_position(m: ModelArith) -> int:
    """Attention-core FLOPs (QK^T and PV) per layer per cached position, for one query token.

    MLA is counted the way the Step-3 paper counts it: both products run over the full cached
    latent row (kv_lora + rope = 576 wide), which is what gives its quoted intensity of 512 at
    8-bit KV. (Counting PV over the 512-wide latent only would lower MLA core FLOPs by 6%.)
    """
    if m.attention in ("mla", "dsa"):
        return 2 * 2 * m.num_heads * (m.kv_lora_rank + m.qk_rope_dim)
    return 2 * 2 * m.num_heads * m.head_dim  # GQA and MFA: every query head reads its K/V head


def attention_linear_params_per_layer(m: ModelArith) -> int:
    """Weights of the attention projections of one layer (= MACs per token in decode)."""
    h = m.hidden_size
    if m.attention in ("mla", "dsa"):
        qk_head = m.qk_nope_dim + m.qk_rope_dim
        q = (
            (h * m.q_lora_rank + m.q_lora_rank * m.num_heads * qk_head)
            if m.q_lora_rank
            else (h * m.num_heads * qk_head)
        )
        kv_a = h * (m.kv_lora_rank + m.qk_rope_dim)
        # kv_b holds W_UK and W_UV; in absorbed decode they multiply q and the output instead of
        # the cache, costing the same MACs per token as their parameter count.
        kv_b = m.kv_lora_rank * m.num_heads * (m.qk_nope_dim + m.v_head_dim)
        o = m.num_heads * m.v_head_dim * h
        indexer = 0
        if m.attention == "dsa":  # wq_b from the query latent, wk and the head weights from x
            indexer = m.q_lora_rank * m.index_n_heads * m.index_head_dim
            indexer += h * (m.index_head_dim + m.index_n_heads)
        return q + kv_a + kv_b + o + indexer
    q_size = m.num_heads * m.head_dim
    if m.q_lora_rank:  # MFA: x -> share_q_dim -> norm -> all heads
        q = h * m.q_lora_rank + m.q_lora_rank * q_size
    else:
        q = h * q_size
    kv = 2 * h * m.num_kv_heads * m.head_dim
    return q + kv + q_size * h


def expert_params(m: ModelArith, width: int) -> int:
    return 3 * m.hidden_size * width  # SiLU-gated MLP: gate, up, down


@dataclass(frozen=True)
class ParamCounts:
    attention: int  # all layers' attention projections
    routed_total: int  # every routed expert of every MoE layer
    routed_active: int  # top_k routed experts per MoE layer
    shared: int
    dense: int  # dense layers' MLPs
    router: int
    embedding: int  # input embedding + LM head (once if tied)

    @property
    def ffn_total(self) -> int:
        return self.routed_total + self.shared + self.dense

    @property
    def ffn_active(self) -> int:
        return self.routed_active + self.shared + self.dense

    @property
    def attention_side(self) -> int:
        """What an afd attention server holds: attention, router, embedding, LM head."""
        return self.attention + self.router + self.embedding

    @property
    def total(self) -> int:
        return self.attention_side + self.ffn_total

    @property
    def activated(self) -> int:
        return self.attention_side + self.ffn_active


def param_counts(m: ModelArith) -> ParamCounts:
    moe, dense = m.moe_layers, m.dense_layers
    per_expert = expert_params(m, m.moe_intermediate_size) if moe else 0
    return ParamCounts(
        attention=m.num_layers * attention_linear_params_per_layer(m),
        routed_total=moe * m.num_experts * per_expert,
        routed_active=moe * m.top_k * per_expert,
        shared=moe * expert_params(m, m.shared_expert_intermediate_size),
        dense=dense * expert_params(m, m.dense_intermediate_size),
        router=moe * m.hidden_size * m.num_experts,
        embedding=m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2),
    )


@dataclass(frozen=True)
class TokenArith:
    """One decoded token at context `context`, all layers."""

    context: int
    kv_dtype: str
    attn_core_flops: float
    attn_linear_flops: float
    kv_bytes: float  # KV cache read
    router_flops: float
    lm_head_flops: float
    ffn_routed_flops: float
    ffn_shared_flops: float
    ffn_dense_flops: float

    @property
    def ffn_flops(self) -> float:
        return self.ffn_routed_flops + self.ffn_shared_flops + self.ffn_dense_flops

    @property
    def attn_intensity(self) -> float:
        """FLOPs of the attention core per byte of KV read."""
        return self.attn_core_flops / self.kv_bytes if self.kv_bytes else 0.0


def token_arith(m: ModelArith, context: int, kv_dtype: str = "fp8") -> TokenArith:
    if context < 1:
        raise PlanError(f"context length must be at least 1 (got {context})")
    p = param_counts(m)
    n = m.num_layers
    return TokenArith(
        context=context,
        kv_dtype=kv_dtype,
        attn_core_flops=float(n * core_flops(m, context)),
        attn_linear_flops=2.0 * p.attention,
        kv_bytes=float(n * kv_read_elems(m, context) * dtype_bytes(kv_dtype)),
        router_flops=2.0 * p.router,
        lm_head_flops=2.0 * m.vocab_size * m.hidden_size,
        ffn_routed_flops=2.0 * p.routed_active,
        ffn_shared_flops=2.0 * p.shared,
        ffn_dense_flops=2.0 * p.dense,
    )


def arithmetic_intensity(m: ModelArith, kv_dtype: str = "fp8", context: int = 0) -> float:
    """Attention-core FLOPs per KV byte read: independent of context for dense attention; for
    DSA at `context` (0: past its top-k, where it has settled to the indexer's)."""
    if m.attention == "dsa":
        ctx = context or 64 * m.index_topk
        return core_flops(m, ctx) / (kv_read_elems(m, ctx) * dtype_bytes(kv_dtype))
    return core_flops_per_position(m) / (kv_elems_per_layer(m) * dtype_bytes(kv_dtype))


def kv_bytes_per_sequence(m: ModelArith, context: int, kv_dtype: str = "fp8") -> float:
    """KV cache one sequence of `context` tokens holds (what memory sizing needs)."""
    return float(m.num_layers * context * kv_elems_per_layer(m) * dtype_bytes(kv_dtype))


def moe_sparsity(m: ModelArith) -> float:
    """Fraction of an MoE layer's FFN weights one token uses: (top_k + shared) / (all + shared)."""
    if not m.moe_layers:
        return 1.0
    shared = m.shared_expert_intermediate_size / m.moe_intermediate_size
    return (m.top_k + shared) / (m.num_experts + shared)
