"""`afd plan`: decoding cost per 1M tokens, xAyF deployments, and advice from live metrics.

    afd plan cost   [--model M ...] [--context L] [--hardware H800,H20,...]
    afd plan [deploy] [--model M] [--context L] [--tpot-ms T] [--micro-batches S]
                      [--attention-hw ...] [--ffn-hw ...] [--target-tps N] [--network-gbps G]
    afd plan --from-metrics URL [--from-metrics URL ...]
Common: --hardware-file FILE, --json. Exit status 2 with `error: ...` on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from afd.errors import AfdError
from afd.plan import report
from afd.plan.arithmetic import token_arith
from afd.plan.cost import (
    CostAssumptions,
    cost_table,
    ffn_batch_for_utilisation,
    min_ffn_chips_for_sparsity,
    min_moe_sparsity,
)
from afd.plan.errors import PlanError
from afd.plan.hardware import Catalog, load_catalog, lookup_many
from afd.plan.metrics_input import measured_times, read_source, recommend
from afd.plan.models import resolve_model
from afd.plan.planner import PAPER_CHIPS, PlanRequest, plan

PAPER_MODELS = ("step3", "deepseek-v3", "qwen3-235b-a22b")
DEFAULT_CHIPS = ",".join(PAPER_CHIPS)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object; dispatch the parsed args to `run`."""
    p = subparsers.add_parser(
        "plan",
        help="decoding cost model and attention/FFN deployment planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=("deploy", "cost"),
        default="deploy",
        help="deploy: rank xAyF deployments (default); cost: USD per 1M tokens",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="PRESET|DIR",
        help="preset (step3, deepseek-v3, qwen3-235b-a22b, qwen3-30b-a3b, "
        "mixtral-8x7b) or a checkpoint dir; repeat for cost",
    )
    p.add_argument("--context", type=int, default=8192, help="context length L (tokens)")
    p.add_argument("--kv-dtype", default="fp8", help="KV cache dtype: fp8 | bf16 | fp32")
    p.add_argument(
        "--compute-dtype",
        default="fp8",
        choices=("fp8", "bf16"),
        help="matmul dtype where the chip has it (chips without FP8 use BF16)",
    )
    p.add_argument("--mfu", type=float, default=1.0, help="fraction of peak FLOP/s reached")
    p.add_argument("--mbu", type=float, default=1.0, help="fraction of peak bandwidth reached")
    p.add_argument("--hardware", default=DEFAULT_CHIPS, help="cost: chips (comma list or all)")
    p.add_argument("--hardware-file", metavar="JSON", help="extra or overriding chip entries")
    p.add_argument("--attention-hw", default=DEFAULT_CHIPS, help="deploy: attention chips")
    p.add_argument("--ffn-hw", default=DEFAULT_CHIPS, help="deploy: FFN chips")
    p.add_argument("--tpot-ms", type=float, default=50.0, help="TPOT SLA in milliseconds")
    p.add_argument("--micro-batches", type=int, default=3, help="pipeline micro-batches S")
    p.add_argument("--target-tps", type=float, default=100_000.0, help="decoded tokens/s")
    p.add_argument("--network-gbps", type=float, help="per-chip network (default: catalog)")
    p.add_argument("--chips-per-instance", type=int, default=8)
    p.add_argument("--max-instances", type=int, default=8, help="largest x and y tried")
    p.add_argument("--top", type=int, default=10, help="deployments shown")
    p.add_argument("--show-rejected", action="store_true", help="list every rejected candidate")
    p.add_argument(
        "--from-metrics",
        action="append",
        metavar="URL|FILE",
        help="recommend x:y and micro-batches from live /metrics (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _cost(args: argparse.Namespace, catalog: Catalog) -> tuple[Any, str]:
    a = CostAssumptions(args.kv_dtype, args.compute_dtype, args.mfu, args.mbu)
    chips = lookup_many(catalog, args.hardware)
    out_json, out_text = [], []
    for spec in args.model or PAPER_MODELS:
        m = resolve_model(spec)
        c = cost_table(m, chips, args.context, a)
        t = token_arith(m, args.context, a.kv_dtype)
        budget = args.tpot_ms / 1e3 / (m.num_layers * args.micro_batches)
        sizing = []
        for h in chips:
            if not (args.network_gbps or h.net_gbps):
                continue  # no network figure: sizing needs one
            b = min_moe_sparsity(m, h, budget, args.network_gbps, compute_dtype=a.compute_dtype)
            batch = ffn_batch_for_utilisation(m, h, 0.9, a.compute_dtype)
            sizing.append((b, batch, min_ffn_chips_for_sparsity(m, b.min_sparsity)))
        out_json.append(report.cost_dict(c, m, t, sizing))
        out_text.append(report.cost_text(c, m, t, sizing))
    return {"costs": out_json}, "\n\n".join(out_text)


def _deploy(args: argparse.Namespace, catalog: Catalog) -> tuple[Any, str]:
    if args.model and len(args.model) > 1:
        raise PlanError("deploy plans one model at a time: give --model once")
    r = PlanRequest(
        model=resolve_model((args.model or ["step3"])[0]),
        context=args.context,
        tpot_s=args.tpot_ms / 1e3,
        micro_batches=args.micro_batches,
        attention_hw=tuple(args.attention_hw.split(",")),
        ffn_hw=tuple(args.ffn_hw.split(",")),
        target_tps=args.target_tps,
        network_gbps=args.network_gbps,
        chips_per_instance=args.chips_per_instance,
        max_attention=args.max_instances,
        max_ffn=args.max_instances,
        kv_dtype=args.kv_dtype,
        compute_dtype=args.compute_dtype,
        mfu=args.mfu,
        mbu=args.mbu,
    )
    p = plan(r, catalog)
    top = max(1, args.top)
    return report.plan_dict(p, top, args.show_rejected), report.plan_text(
        p, top, args.show_rejected
    )


def _metrics(args: argparse.Namespace) -> tuple[Any, str]:
    m = measured_times([read_source(s) for s in args.from_metrics])
    rec = recommend(m, max_servers=args.max_instances)
    return report.metrics_dict(m, rec), report.metrics_text(m, rec)


def run(args: argparse.Namespace) -> int:
    """Execute a parsed `afd plan`; 0 on success, 2 (with `error: ...` on stderr) on bad input."""
    try:
        catalog = load_catalog(args.hardware_file)
        if args.from_metrics:
            data, text = _metrics(args)
        elif args.action == "cost":
            data, text = _cost(args, catalog)
        else:
            data, text = _deploy(args, catalog)
    except AfdError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2) if args.json else text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: `python -m afd.plan ...` is `afd plan ...`."""
    parser = argparse.ArgumentParser(prog="afd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)]))
