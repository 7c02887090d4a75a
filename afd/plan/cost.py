"""The Step-3 paper's decoding-cost model (arXiv 2507.19427, sections 4-5), plus FFN sizing.

Cost per token, with every chip rented by the hour and run at its roofline:
    attention = max(FLOP_core * $/FLOP, KV_bytes * $/byte) + FLOP_linear * $/FLOP
    FFN       = FLOP_FFN * $/FLOP
With AFD each part runs on its own cheapest chip; the network is assumed fully overlapped.

The paper's Table 6 is reproduced (every cell within 2%) by these assumptions, which its text does
not all spell out: 8-bit KV cache; FLOPs are priced at the chip's FP8 peak where it has FP8 units
(H800, H20) and at its BF16 peak where it has not (A800, 910B); MFU and bandwidth use 100%; the
router, LM head and embedding are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from afd.plan.arithmetic import TokenArith, dtype_bytes, token_arith
from afd.plan.errors import PlanError
from afd.plan.hardware import Hardware
from afd.plan.models import ModelArith

PER = 1e6  # costs are per 1M decoded tokens


@dataclass(frozen=True)
class CostAssumptions:
    kv_dtype: str = "fp8"
    compute_dtype: str = "fp8"  # preferred matmul dtype; chips without FP8 fall back to BF16
    mfu: float = 1.0  # fraction of peak FLOP/s achieved
    mbu: float = 1.0  # fraction of peak memory bandwidth achieved
    count_head_and_router: bool = False  # the paper leaves them out

    def __post_init__(self) -> None:
        dtype_bytes(self.kv_dtype)
        if self.compute_dtype not in ("fp8", "bf16"):
            raise PlanError(f"compute dtype must be fp8 or bf16 (got {self.compute_dtype!r})")
        for f in ("mfu", "mbu"):
            if not 0 < getattr(self, f) <= 1:
                raise PlanError(f"{f} must be in (0, 1] (got {getattr(self, f)})")


def dollars_per_flop(hw: Hardware, a: CostAssumptions) -> float:
    return hw.require_price() / 3600 / (hw.flops(a.compute_dtype) * a.mfu)


def dollars_per_byte(hw: Hardware, a: CostAssumptions) -> float:
    return hw.require_price() / 3600 / (hw.mem_bandwidth * a.mbu)


@dataclass(frozen=True)
class ChipCost:
    """USD per 1M tokens of each part on one chip."""

    hardware: str
    compute_dtype: str
    attn_core: float
    kv_access: float
    attn_linear: float
    ffn: float

    @property
    def attention(self) -> float:
        return max(self.attn_core, self.kv_access) + self.attn_linear

    @property
    def attention_bound(self) -> str:
        return "memory" if self.kv_access >= self.attn_core else "compute"

    @property
    def total(self) -> float:
        return self.attention + self.ffn


def chip_cost(t: TokenArith, hw: Hardware, a: CostAssumptions) -> ChipCost:
    flop, byte = dollars_per_flop(hw, a), dollars_per_byte(hw, a)
    linear = t.attn_linear_flops
    if a.count_head_and_router:  # both run on the attention side in afd
        linear += t.router_flops + t.lm_head_flops
    return ChipCost(
        hardware=hw.name,
        compute_dtype=hw.compute_dtype(a.compute_dtype),
        attn_core=t.attn_core_flops * flop * PER,
        kv_access=t.kv_bytes * byte * PER,
        attn_linear=linear * flop * PER,
        ffn=t.ffn_flops * flop * PER,
    )


@dataclass(frozen=True)
class ModelCost:
    """The paper's Table 6 for one model at one context length."""

    model: str
    context: int
    rows: tuple[ChipCost, ...]
    best_attention: str  # chip
    best_ffn: str
    best_afd_total: float
    best_non_afd: str  # cheapest chip running both parts
    best_non_afd_total: float
    unpriced: tuple[str, ...] = ()  # chips asked for but left out: no price_per_hour

    @property
    def afd_saving(self) -> float:
        """Fraction of the best single-chip cost that AFD saves."""
        return 1 - self.best_afd_total / self.best_non_afd_total


def cost_table(
    m: ModelArith, hardware: list[Hardware], context: int, a: CostAssumptions | None = None
) -> ModelCost:
    a = a or CostAssumptions()
    priced = [h for h in hardware if h.price_per_hour is not None]
    if not priced:
        names = ", ".join(h.name for h in hardware)
        raise PlanError(f"none of {names} has a price: give price_per_hour in a --hardware-file")
    t = token_arith(m, context, a.kv_dtype)
    rows = tuple(chip_cost(t, h, a) for h in priced)
    att = min(rows, key=lambda r: r.attention)
    ffn = min(rows, key=lambda r: r.ffn)
    single = min(rows, key=lambda r: r.total)
    return ModelCost(
        model=m.name,
        context=context,
        rows=rows,
        best_attention=att.hardware,
        best_ffn=ffn.hardware,
        best_afd_total=att.attention + ffn.ffn,
        best_non_afd=single.hardware,
        best_non_afd_total=single.total,
        unpriced=tuple(h.name for h in hardware if h.price_per_hour is None),
    )


# --- FFN sizing: how many tokens an FFN chip needs, and whether the network can bring them ----


def roofline_tokens_per_expert(
    hw: Hardware, compute_dtype: str = "fp8", weight_dtype: str | None = None
) -> float:
    """Tokens an expert must see per call for its matmuls to be compute- not memory-bound.

    Each token does 2 FLOPs per weight; each weight costs `weight bytes` to read once. Weights
    default to the chip's compute dtype (FP8 on chips with FP8 units, else BF16).
    """
    wdtype = weight_dtype or hw.compute_dtype(compute_dtype)
    return hw.flops(compute_dtype) * dtype_bytes(wdtype) / (2 * hw.mem_bandwidth)


def ffn_batch_for_utilisation(
    m: ModelArith,
    hw: Hardware,
    utilisation: float = 0.9,
    compute_dtype: str = "fp8",
    weight_dtype: str | None = None,
) -> int:
    """Tokens per layer call an FFN instance needs so that the average routed expert reaches
    `utilisation` of peak FLOP/s (roofline: utilisation = tokens per expert / roofline tokens).
    """
    if not 0 < utilisation <= 1:
        raise PlanError(f"utilisation must be in (0, 1] (got {utilisation})")
    per_expert = utilisation * roofline_tokens_per_expert(hw, compute_dtype, weight_dtype)
    if not m.moe_layers:
        return math.ceil(per_expert)
    return math.ceil(per_expert * m.num_experts / m.top_k)


@dataclass(frozen=True)
class WireFormat:
    """Bytes per token on the attention<->FFN wire, as afd sends them (DESIGN.md)."""

    a2f_dtype: str = "fp8"

    def a2f_bytes(self, m: ModelArith) -> int:
        scale = 4 if self.a2f_dtype == "fp8" else 0  # fp32 per-token scale
        routing = 8 * m.top_k if m.moe_layers else 0  # int32 id + fp32 weight per expert
        return m.hidden_size * dtype_bytes(self.a2f_dtype) + scale + routing

    def f2a_bytes(self, m: ModelArith) -> int:
        return 2 * m.hidden_size  # BF16 partial outputs

    def max_bytes(self, m: ModelArith) -> int:
        """The busier direction of a full-duplex link."""
        return max(self.a2f_bytes(m), self.f2a_bytes(m))


@dataclass(frozen=True)
class SparsityBound:
    hardware: str
    net_gbps: float
    layer_budget_s: float
    roofline_tokens: float  # per expert
    network_tokens: float  # tokens one FFN chip can receive (and answer) per layer budget
    min_sparsity: float  # fraction of a chip's resident expert weights each token must use

    def supports(self, sparsity: float) -> bool:
        return sparsity >= self.min_sparsity


def min_moe_sparsity(
    m: ModelArith,
    hw: Hardware,
    layer_budget_s: float,
    net_gbps: float | None = None,
    wire: WireFormat | None = None,
    compute_dtype: str = "fp8",
    weight_dtype: str | None = None,
) -> SparsityBound:
    """The sparsity below which an FFN chip cannot be kept compute-bound.

    Within one layer's budget the network can bring an FFN chip at most N tokens. For its experts
    to be compute-bound each needs `roofline` tokens, so each arriving token must use at least
    roofline / N of the chip's resident expert weights: the minimum sparsity.
    """
    wire = wire or WireFormat()
    gbps = net_gbps or hw.net_gbps
    if not gbps:
        raise PlanError(f"hardware {hw.name!r} has no network bandwidth: pass --network-gbps")
    if layer_budget_s <= 0:
        raise PlanError("the per-layer time budget must be positive")
    tokens = gbps * 1e9 / 8 * layer_budget_s / wire.max_bytes(m)
    roof = roofline_tokens_per_expert(hw, compute_dtype, weight_dtype)
    return SparsityBound(hw.name, gbps, layer_budget_s, roof, tokens, roof / tokens)


def _miss_probability(experts: int, top_k: int, servers: int) -> float:
    """P(a token's top_k distinct experts all avoid one server holding experts/servers)."""
    held = experts / servers
    p = 1.0
    for i in range(top_k):
        p *= max(0.0, (experts - held - i) / (experts - i))
    return p


def min_ffn_chips_for_sparsity(m: ModelArith, min_sparsity: float) -> int | None:
    """Smallest expert-parallel degree at which each chip sees `min_sparsity` of its weights used.

    Splitting experts over G chips raises the per-chip sparsity: a token reaching a chip uses
    (top_k / G) / P(hit) of its num_experts / G experts. None: not even one expert per chip does.
    """
    if not m.moe_layers:
        return 1 if min_sparsity <= 1 else None
    for g in range(1, m.num_experts + 1):
        hit = 1 - _miss_probability(m.num_experts, m.top_k, g)
        if m.top_k / (m.num_experts * hit) >= min_sparsity:
            return g
    return None


def servers_per_token(m: ModelArith, ffn_servers: int) -> float:
    """Expected FFN servers one token's FFN message goes to, averaged over layers.

    Experts are split evenly over the servers; one server holds the shared expert / dense MLP.
    """
    if ffn_servers < 1:
        raise PlanError("need at least one FFN server")
    if not m.moe_layers:
        return 1.0
    miss = _miss_probability(m.num_experts, m.top_k, ffn_servers)
    moe = ffn_servers * (1 - miss) + (miss if m.shared_expert_intermediate_size else 0.0)
    return (m.moe_layers * moe + m.dense_layers * 1.0) / m.num_layers


@dataclass(frozen=True)
class LayerTraffic:
    tokens: int
    ffn_servers: int
    servers_per_token: float
    a2f_bytes: float  # attention -> FFN, one layer, all tokens
    f2a_bytes: float


def layer_traffic(
    m: ModelArith, tokens: int, ffn_servers: int, wire: WireFormat | None = None
) -> LayerTraffic:
    wire = wire or WireFormat()
    fan = servers_per_token(m, ffn_servers)
    return LayerTraffic(
        tokens=tokens,
        ffn_servers=ffn_servers,
        servers_per_token=fan,
        a2f_bytes=tokens * fan * wire.a2f_bytes(m),
        f2a_bytes=tokens * fan * wire.f2a_bytes(m),
    )
