"""`afd bench spec --serve`: speculative decoding through the API. `afd serve` on the benchmark
checkpoint with and without `--speculative-config`, each started fresh for every round, the
rounds alternating; each run driven by `afd bench serve` (greedy, `--ignore-eos`) at each
`--concurrency`. Reported per concurrency: each side's median mean TPOT and output tok/s over
the rounds, their ratios, and every run."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _drive(url: str, concurrency: int, args: argparse.Namespace, seed: int) -> dict:
    from afd_cli.bench.peer import bench_serve

    out = bench_serve(
        url, "--concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
        "--num-requests", str(max(6, 2 * concurrency)), "--input-len", str(args.prompt_len),
        "--output-len", str(args.new_tokens), "--seed", str(seed),
    )  # fmt: skip
    return {"tpot_ms": out["tpot_s"]["mean"] * 1e3, "output_tok_s": out["output_throughput"]}


def run(args: argparse.Namespace) -> dict:
    from afd_cli.bench.engine import _cpu, build_checkpoint
    from afd_cli.bench.peer import _stop, start_afd_serve

    model = build_checkpoint(Path(args.cache_dir) / "bench-qwen3moe-ref")
    sides = {"plain": [], "spec": ["--speculative-config", args.speculative_config]}
    runs: dict[int, dict[str, list[dict]]] = {c: {s: [] for s in sides} for c in args.concurrency}
    for rnd in range(args.repeat):
        for side, extra in sides.items():
            proc, url = start_afd_serve(model, extra, 300)
            try:
                for c in args.concurrency:
                    runs[c][side].append(_drive(url, c, args, seed=rnd))
            finally:
                _stop(proc)
    results = []
    for c, by_side in runs.items():
        med = {
            s: {k: statistics.median(r[k] for r in rs) for k in ("tpot_ms", "output_tok_s")}
            for s, rs in by_side.items()
        }
        row = {
            "concurrency": c,
            "plain_tpot_ms": round(med["plain"]["tpot_ms"], 2),
            "spec_tpot_ms": round(med["spec"]["tpot_ms"], 2),
            "plain_output_tok_s": round(med["plain"]["output_tok_s"], 1),
            "spec_output_tok_s": round(med["spec"]["output_tok_s"], 1),
            "output_ratio": round(med["spec"]["output_tok_s"] / med["plain"]["output_tok_s"], 2),
            "runs": {
                s: [{k: round(v, 2) for k, v in r.items()} for r in rs] for s, rs in by_side.items()
            },  # fmt: skip
        }
        results.append(row)
    return {
        "benchmark": "speculative_decoding_serve",
        "config": "qwen3_moe hidden 1024, 8 layers, 32 experts top-4, bf16 (random weights)",
        "speculative_config": json.loads(args.speculative_config),
        "cpu": _cpu(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rounds": args.repeat,
        "results": results,
    }
