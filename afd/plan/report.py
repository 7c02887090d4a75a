"""Results as tables for people and as JSON-ready dicts for machines (no computation here)."""

from __future__ import annotations

import dataclasses
from typing import Any

from afd.plan.arithmetic import TokenArith, arithmetic_intensity, moe_sparsity, param_counts
from afd.plan.cost import ChipCost, ModelCost, SparsityBound
from afd.plan.metrics_input import Measured, Recommendation
from afd.plan.models import ModelArith
from afd.plan.planner import Candidate, Plan


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


# --- cost ---------------------------------------------------------------------------------------


def chip_dict(r: ChipCost) -> dict[str, Any]:
    return {
        **dataclasses.asdict(r),
        "attention": r.attention,
        "attention_bound": r.attention_bound,
        "total": r.total,
    }


def arith_dict(m: ModelArith, t: TokenArith) -> dict[str, Any]:
    p = param_counts(m)
    return {
        "attention": m.attention,
        "activated_params": p.activated,
        "total_params": p.total,
        "attention_intensity": arithmetic_intensity(m, t.kv_dtype, t.context),
        "moe_sparsity": moe_sparsity(m),
        "per_token": {**dataclasses.asdict(t), "ffn_flops": t.ffn_flops},
    }


def cost_dict(
    c: ModelCost, m: ModelArith, t: TokenArith, sizing: list[tuple[SparsityBound, int, int | None]]
) -> dict[str, Any]:
    return {
        "model": c.model,
        "context": c.context,
        "usd_per_mtok": [chip_dict(r) for r in c.rows],
        "best_afd": {
            "attention": c.best_attention,
            "ffn": c.best_ffn,
            "total": c.best_afd_total,
        },
        "best_non_afd": {"hardware": c.best_non_afd, "total": c.best_non_afd_total},
        "afd_saving": c.afd_saving,
        "arithmetic": arith_dict(m, t),
        "ffn_sizing": [
            {**dataclasses.asdict(b), "ffn_batch_90pct": batch, "min_ffn_chips": chips}
            for b, batch, chips in sizing
        ],
    }


def cost_text(
    c: ModelCost, m: ModelArith, t: TokenArith, sizing: list[tuple[SparsityBound, int, int | None]]
) -> str:
    p = param_counts(m)
    rows = [
        [r.hardware, r.compute_dtype]
        + [
            f"{v:.4f}"
            for v in (r.attn_core, r.kv_access, r.attn_linear, r.attention, r.ffn, r.total)
        ]
        for r in c.rows
    ]
    head = ["chip", "flops", "attn core", "KV read", "attn linear", "ATTENTION", "FFN", "total"]
    att = next(r for r in c.rows if r.hardware == c.best_attention)
    ffn = next(r for r in c.rows if r.hardware == c.best_ffn)
    out = [
        f"{c.model} @ {c.context} tokens: USD per 1M decoded tokens (KV {t.kv_dtype})",
        table(head, rows),
        f"best AFD: attention on {att.hardware} ({att.attention:.4f}) + FFN on {ffn.hardware} "
        f"({ffn.ffn:.4f}) = {c.best_afd_total:.4f}",
        f"best without AFD: {c.best_non_afd} {c.best_non_afd_total:.4f} "
        f"(AFD saves {c.afd_saving:.0%})",
        f"params: {p.activated / 1e9:.1f}B activated / {p.total / 1e9:.1f}B total; "
        f"{m.attention.upper()} intensity {arithmetic_intensity(m, t.kv_dtype, t.context):.0f} "
        "FLOP/B; "
        f"KV read {t.kv_bytes / 1e6:.0f} MB/token; MoE sparsity {moe_sparsity(m):.3f}",
    ]
    if c.unpriced:
        out.append(f"not costed (no price; set one with --hardware-file): {', '.join(c.unpriced)}")
    if sizing:
        budget = sizing[0][0].layer_budget_s * 1e6
        srows = [
            [
                b.hardware,
                f"{b.net_gbps:g}",
                f"{b.roofline_tokens:.0f}",
                f"{batch}",
                f"{b.network_tokens:.0f}",
                f"{b.min_sparsity:.3f}",
                "-" if chips is None else str(chips),
            ]
            for b, batch, chips in sizing
        ]
        shead = ["FFN chip", "net Gb/s", "tok/expert", "batch@90%", "net tok/layer"]
        out += [
            f"FFN sizing, {budget:.0f} us per layer:",
            table(shead + ["min sparsity", "min EP chips"], srows),
        ]
    return "\n".join(out)


# --- deployment plan ----------------------------------------------------------------------------


def candidate_dict(c: Candidate) -> dict[str, Any]:
    d = dataclasses.asdict(c)
    d["name"] = c.name
    return d


def plan_dict(p: Plan, top: int, show_rejected: bool) -> dict[str, Any]:
    r = p.request
    return {
        "model": r.model.name,
        "request": {k: v for k, v in dataclasses.asdict(r).items() if k != "model"},
        "layer_budget_s": p.layer_budget_s,
        "deployments": [candidate_dict(c) for c in p.feasible[:top]],
        "feasible": len(p.feasible),
        "rejections": p.rejection_counts(),
        "rejected": [candidate_dict(c) for c in p.rejected] if show_rejected else [],
    }


def plan_text(p: Plan, top: int, show_rejected: bool) -> str:
    r = p.request
    rows = []
    for i, c in enumerate(p.feasible[:top], 1):
        st = c.stages
        assert st is not None  # feasible candidates always carry their stage times
        times = "/".join(f"{v * 1e6:.0f}" for v in (st.attention, st.a2f, st.ffn, st.f2a))
        rows.append(
            [str(i), c.name, f"{c.batch_per_chip} ({c.batch_limit})", str(c.tokens_per_microbatch)]
            + [f"{c.tpot_s * 1e3:.1f}", times, f"{c.network_gbps_used:.0f}", f"{c.unit_tps:.0f}"]
            + [str(c.replicas), str(c.chips), f"{c.dollars_per_hour:.1f}"]
            + [f"{c.dollars_per_mtok:.4f}"]
        )
    head = ["#", "deployment", "batch/chip", "tok/ubatch", "TPOT ms", "A/a2f/F/f2a us"]
    head += ["net Gb/s", "unit tok/s", "units", "chips", "$/h", "$/1M tok"]
    out = [
        f"{r.model.name}, context {r.context}, TPOT {r.tpot_s * 1e3:g} ms, "
        f"{r.micro_batches} micro-batches: {p.layer_budget_s * 1e6:.0f} us per layer stage; "
        f"target {r.target_tps:g} tok/s; {r.chips_per_instance} chips per instance",
        table(head, rows),
        f"{len(p.feasible)} feasible, ranked by $/h for the target; rejected: "
        + (", ".join(f"{k} {v}" for k, v in sorted(p.rejection_counts().items())) or "none"),
    ]
    shown: set[str] = set()
    for c in p.rejected:
        if show_rejected or c.rejected not in shown:
            out.append(f"  rejected {c.name}: {c.rejected}: {c.reason}")
            shown.add(c.rejected)
    return "\n".join(out)


# --- live metrics -------------------------------------------------------------------------------


def metrics_dict(m: Measured, rec: Recommendation) -> dict[str, Any]:
    return {"measured": dataclasses.asdict(m), "recommendation": dataclasses.asdict(rec)}


def metrics_text(m: Measured, rec: Recommendation) -> str:
    peers = ", ".join(f"{p} {t * 1e3:.3f} ms" for p, t in m.roundtrip_by_peer) or "unlabelled"
    return "\n".join(
        [
            f"measured over {m.samples} attention layer calls, {m.ffn_servers} FFN server(s):",
            f"  attention per layer  {m.attention_layer_s * 1e3:.3f} ms",
            f"  FFN compute per call {m.ffn_compute_s * 1e3:.3f} ms",
            f"  round trip           {m.roundtrip_s * 1e3:.3f} ms ({peers})",
            f"  network + queueing   {rec.network_s * 1e3:.3f} ms",
            f"recommended: attention:FFN = {rec.ratio:.2f} -> {rec.attention_servers}A"
            f"{rec.ffn_servers}F, {rec.micro_batches} micro-batches "
            f"(predicted FFN utilisation {rec.predicted_ffn_utilisation:.0%})",
        ]
    )
