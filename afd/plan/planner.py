"""The xAyF planner: which attention and FFN chips, how many of each, at what batch.

A deployment unit is x attention instances and y FFN instances of `chips_per_instance` chips
each. Attention is data-parallel (every attention chip holds the attention weights and its own
sequences); the y FFN instances together hold one copy of the FFN weights, experts split evenly
(afd's expert parallelism). Units are replicated until they carry the traffic target.

Timing is the roofline of each stage for one micro-batch of one layer, S micro-batches in flight:
    layer time = max(S * slowest stage, attention + A2F + FFN + F2A)   (pipelined vs round trip)
    TPOT       = layers * layer time + S * LM-head time
The paper's per-layer budget is TPOT / (layers * S): 50 ms / 61 / 3 = 272 us.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from afd.plan import arithmetic as ar
from afd.plan.cost import WireFormat, servers_per_token
from afd.plan.errors import PlanError
from afd.plan.hardware import GIB, Catalog, Hardware, lookup_many
from afd.plan.models import ModelArith

PAPER_CHIPS = ("H800", "H20", "A800", "910B")


@dataclass(frozen=True)
class PlanRequest:
    model: ModelArith
    context: int = 8192
    tpot_s: float = 0.05
    micro_batches: int = 3
    attention_hw: tuple[str, ...] = PAPER_CHIPS
    ffn_hw: tuple[str, ...] = PAPER_CHIPS
    target_tps: float = 100_000.0  # decoded tokens per second, whole deployment
    network_gbps: float | None = None  # per chip; None: each chip's catalog value
    chips_per_instance: int = 8
    max_attention: int = 8  # x in 1..max_attention
    max_ffn: int = 8
    kv_dtype: str = "fp8"
    compute_dtype: str = "fp8"  # weights and matmuls; chips without FP8 use BF16
    a2f_dtype: str = "fp8"
    mem_fraction: float = 0.9  # of chip memory usable for weights + KV
    mfu: float = 1.0
    mbu: float = 1.0

    def __post_init__(self) -> None:
        checks = [
            (self.context >= 1, f"context must be at least 1 (got {self.context})"),
            (self.tpot_s > 0, f"TPOT SLA must be positive (got {self.tpot_s * 1e3:g} ms)"),
            (1 <= self.micro_batches <= 16, "micro-batches must be in 1..16"),
            (self.target_tps > 0, "traffic target must be positive tokens/s"),
            (self.chips_per_instance >= 1, "chips per instance must be at least 1"),
            (self.max_attention >= 1 and self.max_ffn >= 1, "max instances must be >= 1"),
            (0 < self.mem_fraction <= 1, "memory fraction must be in (0, 1]"),
            (0 < self.mfu <= 1 and 0 < self.mbu <= 1, "mfu and mbu must be in (0, 1]"),
            (self.network_gbps is None or self.network_gbps > 0, "network must be positive"),
        ]
        for ok, msg in checks:
            if not ok:
                raise PlanError(msg)
        for d in (self.kv_dtype, self.compute_dtype, self.a2f_dtype):
            ar.dtype_bytes(d)

    @property
    def layer_budget_s(self) -> float:
        return self.tpot_s / (self.model.num_layers * self.micro_batches)


@dataclass(frozen=True)
class StageTimes:
    """Seconds for one micro-batch of one (average) layer."""

    attention: float
    a2f: float
    ffn: float
    f2a: float

    def layer(self, micro_batches: int) -> float:
        slowest = max(self.attention, self.a2f, self.ffn, self.f2a)
        return max(micro_batches * slowest, self.attention + self.a2f + self.ffn + self.f2a)

    def bottleneck(self) -> str:
        named = {"attention": self.attention, "network": max(self.a2f, self.f2a), "FFN": self.ffn}
        return max(named, key=lambda k: named[k])


@dataclass(frozen=True)
class Candidate:
    attention_hw: str
    ffn_hw: str
    x: int  # attention instances per unit
    y: int  # FFN instances per unit
    rejected: str = ""  # "" | "memory" | "latency" | "network" | "price"
    reason: str = ""
    batch_per_chip: int = 0  # sequences per attention chip per micro-batch
    batch_limit: str = ""  # what stopped a larger batch: "memory" | "latency"
    tokens_per_microbatch: int = 0  # at the FFN side, per unit
    stages: StageTimes | None = None
    tpot_s: float = 0.0
    unit_tps: float = 0.0  # tokens/s of one unit
    network_gbps_used: float = 0.0  # busiest chip NIC, one direction, averaged over the step
    replicas: int = 0
    chips: int = 0
    dollars_per_hour: float = 0.0
    dollars_per_mtok: float = 0.0  # at full capacity

    @property
    def name(self) -> str:
        return f"{self.x}A{self.y}F {self.attention_hw}+{self.ffn_hw}"


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    layer_budget_s: float
    feasible: tuple[Candidate, ...]  # cheapest first
    rejected: tuple[Candidate, ...] = field(default=())

    def rejection_counts(self) -> dict[str, int]:
        return dict(Counter(c.rejected for c in self.rejected))


class _Unit:
    """Per-layer arithmetic of one (attention chip, FFN chip, x, y) choice."""

    def __init__(self, r: PlanRequest, ha: Hardware, hf: Hardware, x: int, y: int):
        m, self.r, self.x, self.y = r.model, r, x, y
        self.ha, self.hf = ha, hf
        self.fa = ha.flops(r.compute_dtype) * r.mfu
        self.ff = hf.flops(r.compute_dtype) * r.mfu
        self.ba, self.bf = ha.mem_bandwidth * r.mbu, hf.mem_bandwidth * r.mbu
        self.wa = ar.dtype_bytes(ha.compute_dtype(r.compute_dtype))  # bytes per weight
        self.wf = ar.dtype_bytes(hf.compute_dtype(r.compute_dtype))
        p = ar.param_counts(m)
        self.p, n = p, m.num_layers
        self.core = ar.core_flops(m, r.context)
        self.kv = ar.kv_read_elems(m, r.context) * ar.dtype_bytes(r.kv_dtype)
        self.attn_params = (p.attention + p.router) / n  # per layer, router included
        self.head_params = m.vocab_size * m.hidden_size
        self.ffn_flops = 2.0 * p.ffn_active / n  # per token per layer
        self.g = r.chips_per_instance
        wire = WireFormat(r.a2f_dtype)
        self.fan = servers_per_token(m, y)
        self.a2f_tok, self.f2a_tok = wire.a2f_bytes(m), wire.f2a_bytes(m)
        self.net_a = (r.network_gbps or ha.net_gbps or 0) * 1e9 / 8
        self.net_f = (r.network_gbps or hf.net_gbps or 0) * 1e9 / 8

    def ffn_bytes_read(self, tokens: int) -> float:
        """FFN weight bytes one layer call reads (average layer), whole FFN side."""
        m, p = self.r.model, self.p
        if m.moe_layers:
            touched = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** tokens)
            routed = p.routed_total / m.num_experts * touched / m.num_experts
        else:
            routed = 0.0
        return (routed + p.shared + p.dense) * self.wf / m.num_layers

    def stages(self, b: int) -> StageTimes:
        core = max(b * self.core / self.fa, b * self.kv / self.ba)
        linear = max(2 * b * self.attn_params / self.fa, self.attn_params * self.wa / self.ba)
        tokens = self.x * self.g * b  # one micro-batch, all attention chips of the unit
        ffn_chips = self.y * self.g
        ffn = max(
            tokens * self.ffn_flops / ffn_chips / self.ff,
            self.ffn_bytes_read(tokens) / ffn_chips / self.bf,
        )
        per_ffn_chip = tokens * self.fan / ffn_chips
        a2f = max(
            b * self.fan * self.a2f_tok / self.net_a, per_ffn_chip * self.a2f_tok / self.net_f
        )
        f2a = max(
            b * self.fan * self.f2a_tok / self.net_a, per_ffn_chip * self.f2a_tok / self.net_f
        )
        return StageTimes(core + linear, a2f, ffn, f2a)

    def tpot(self, b: int) -> float:
        head = max(2 * b * self.head_params / self.fa, self.head_params * self.wa / self.ba)
        s = self.r.micro_batches
        return self.r.model.num_layers * self.stages(b).layer(s) + s * head


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def _memory_limit(u: _Unit) -> tuple[int, str]:
    """Largest micro-batch per attention chip that fits in memory, or 0 and why not."""
    r, m = u.r, u.r.model
    usable_a = u.ha.mem_bytes * r.mem_fraction
    weights_a = u.p.attention_side * u.wa
    if weights_a > usable_a:
        return (
            0,
            f"attention weights {_gib(weights_a)} exceed {_gib(usable_a)} usable on {u.ha.name}",
        )
    ffn_chips = u.y * u.g
    per_ffn = u.p.ffn_total * u.wf / ffn_chips
    usable_f = u.hf.mem_bytes * r.mem_fraction
    if per_ffn > usable_f:
        return 0, (
            f"FFN weights over {ffn_chips} {u.hf.name} chips are {_gib(per_ffn)} each, "
            f"over {_gib(usable_f)} usable"
        )
    seq = ar.kv_bytes_per_sequence(m, r.context, r.kv_dtype)
    b = int((usable_a - weights_a) // seq) // r.micro_batches
    if b < 1:
        return 0, (
            f"{r.micro_batches} sequences of {r.context} tokens need {_gib(seq * r.micro_batches)}"
            f" of KV beside {_gib(weights_a)} of weights on {u.ha.name}"
        )
    return b, ""


def _evaluate(r: PlanRequest, ha: Hardware, hf: Hardware, x: int, y: int) -> Candidate:
    base = Candidate(ha.name, hf.name, x, y)
    if ha.price_per_hour is None or hf.price_per_hour is None:
        missing = ha.name if ha.price_per_hour is None else hf.name
        return _reject(base, "price", f"{missing} has no price_per_hour (give one in a file)")
    u = _Unit(r, ha, hf, x, y)
    if not u.net_a or not u.net_f:
        missing = ha.name if not u.net_a else hf.name
        return _reject(base, "network", f"{missing} network bandwidth unknown (--network-gbps)")
    b_mem, why = _memory_limit(u)
    if not b_mem:
        return _reject(base, "memory", why)
    if u.tpot(1) > r.tpot_s:
        st = u.stages(1)
        kind = "network" if st.bottleneck() == "network" else "latency"
        return _reject(
            base,
            kind,
            f"TPOT {u.tpot(1) * 1e3:.1f} ms at 1 sequence per chip > {r.tpot_s * 1e3:g} ms; "
            f"{st.bottleneck()} stage {max(st.attention, st.a2f, st.ffn, st.f2a) * 1e6:.0f} us "
            f"vs budget {r.layer_budget_s * 1e6:.0f} us",
        )
    lo, hi = 1, b_mem  # largest b with tpot(b) <= SLA; tpot grows with b
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if u.tpot(mid) <= r.tpot_s else (lo, mid - 1)
    return _costed(base, u, lo, "memory" if lo == b_mem else "latency")


def _reject(c: Candidate, kind: str, reason: str) -> Candidate:
    return Candidate(c.attention_hw, c.ffn_hw, c.x, c.y, rejected=kind, reason=reason)


def _costed(c: Candidate, u: _Unit, b: int, limit: str) -> Candidate:
    r = u.r
    tpot = u.tpot(b)
    chips_a = u.x * u.g
    unit_tps = chips_a * b * r.micro_batches / tpot
    replicas = math.ceil(r.target_tps / unit_tps)
    unit_price = u.g * (u.x * u.ha.require_price() + u.y * u.hf.require_price())
    st = u.stages(b)
    # busiest NIC's bytes over the whole step, as an average line rate (what a link must carry)
    bytes_a = b * u.fan * max(u.a2f_tok, u.f2a_tok)
    bytes_f = chips_a * b * u.fan / (u.y * u.g) * max(u.a2f_tok, u.f2a_tok)
    per_step = max(bytes_a, bytes_f) * r.micro_batches * r.model.num_layers
    return Candidate(
        **{k: getattr(c, k) for k in ("attention_hw", "ffn_hw", "x", "y")},
        batch_per_chip=b,
        batch_limit=limit,
        tokens_per_microbatch=chips_a * b,
        stages=st,
        tpot_s=tpot,
        unit_tps=unit_tps,
        network_gbps_used=per_step / tpot * 8 / 1e9,
        replicas=replicas,
        chips=replicas * u.g * (u.x + u.y),
        dollars_per_hour=replicas * unit_price,
        dollars_per_mtok=unit_price / (unit_tps * 3600) * 1e6,
    )


def plan(r: PlanRequest, catalog: Catalog) -> Plan:
    """Every xAyF candidate, feasible ones ranked by the cost of serving the target.

    Raises PlanError when no candidate is feasible, with the reasons counted.
    """
    att, ffn = lookup_many(catalog, r.attention_hw), lookup_many(catalog, r.ffn_hw)
    cands = [
        _evaluate(r, ha, hf, x, y)
        for ha in att
        for hf in ffn
        for x in range(1, r.max_attention + 1)
        for y in range(1, r.max_ffn + 1)
    ]
    ok = sorted(
        (c for c in cands if not c.rejected),
        key=lambda c: (c.dollars_per_hour, c.dollars_per_mtok, c.chips),
    )
    bad = tuple(c for c in cands if c.rejected)
    result = Plan(r, r.layer_budget_s, tuple(ok), bad)
    if not ok:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(result.rejection_counts().items()))
        example = min(bad, key=lambda c: c.rejected != "latency").reason if bad else ""
        raise PlanError(
            f"no deployment of {r.model.name} meets TPOT {r.tpot_s * 1e3:g} ms at context "
            f"{r.context} with {r.micro_batches} micro-batches: all {len(bad)} candidates "
            f"rejected ({counts}); e.g. {example}"
        )
    return result
