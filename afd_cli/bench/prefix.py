"""`afd bench prefix`: what prefix caching and prefix-aware routing buy, through the API.

1. **Caching.** `afd serve` with prefix caching and with `--no-prefix-caching`, one after the
   other, alternating over `--rounds`: each run streams `--questions` distinct questions after
   one shared system prompt of `--system-len` tokens (`afd bench serve --shared-prefix-len`) at
   `--concurrency`. Reported: TTFT p50 of each (the median over rounds) and their ratio, and
   the share of prompt tokens the cache supplied (the responses' `cached_tokens`).
2. **Routing.** Two attention servers behind one gateway, `--routing prefix` against
   `--routing round-robin`, alternating: the questions spread over `--prefixes` distinct system
   prompts. Each server's KV pool holds about `--kv-prefixes` of those prompts (and the
   questions and answers in flight), fewer than there are, so a server that sees every prefix
   evicts; the hit rates (the responses' and, per server, the gateway's
   `afd_gateway_server_prefix_cache_hit_rate`) and TTFT p50 of both.

Processes run one cluster at a time on this machine; the load generator is its own process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from afd_cli.bench.peer import _stop, bench_serve, start_afd_serve


def _serve(model: Path, args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, str]:
    return start_afd_serve(model, extra, args.start_timeout)


def _load(url: str, args: argparse.Namespace, prefixes: int) -> dict:
    """One `afd bench serve` run with shared system prompts; its JSON summary."""
    return bench_serve(
        url, "--ignore-eos", "--concurrency", str(args.concurrency),
        "--num-requests", str(args.questions), "--input-len", str(args.question_len),
        "--output-len", str(args.output_len), "--seed", str(args.seed),
        "--shared-prefix-len", str(args.system_len), "--shared-prefixes", str(prefixes),
    )  # fmt: skip


def _server_hit_rates(url: str) -> dict[str, float]:
    """The gateway's view of each attention server's hit rate (after its next poll)."""
    from afd.plan.metrics_input import parse_exposition

    time.sleep(1.0)
    samples = parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text)
    return {
        s.label("server"): round(s.value, 4)
        for s in samples
        if s.name == "afd_gateway_server_prefix_cache_hit_rate"
    }


def _kv_gb(model: Path, args: argparse.Namespace) -> float:
    """KV memory for about `--kv-prefixes` system prompts and the questions and answers of the
    streams in flight (all on one server, at worst): those share their system prompt's blocks
    (a hit takes the cached blocks themselves), so what a server can keep is counted in system
    prompts."""
    import torch

    from afd.config import ModelConfig
    from services.attention.kinds import ATTENTION_KINDS

    mc = ModelConfig.from_hf(model)
    layout = ATTENTION_KINDS[mc.attention].cache_layout(mc)  # what a token leaves in the cache
    per_token = layout.bytes_per_token(mc.num_layers, torch.bfloat16)
    tail = args.question_len + args.output_len + 32  # the last partial block of each, and more
    tokens = args.kv_prefixes * args.system_len + args.concurrency * tail
    return tokens * per_token / (1 << 30)


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def run(args: argparse.Namespace) -> dict:
    from afd_cli.bench.engine import _cpu, build_checkpoint

    model = (
        Path(args.model)
        if args.model
        else build_checkpoint(Path(args.cache_dir) / "bench-qwen3moe-ref")
    )
    caching: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(args.rounds if "caching" in args.parts else 0):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for mode in order:
            proc, url = _serve(model, args, [] if mode == "on" else ["--no-prefix-caching"])
            try:
                s = _load(url, args, 1)
            finally:
                _stop(proc)
            caching[mode].append(
                {"ttft_p50_s": s["ttft_s"]["p50"], "hit_rate": s["prefix_cache_hit_rate"],
                 "ttft_p90_s": s["ttft_s"]["p90"], "output_tok_s": s["output_throughput"]}
            )  # fmt: skip

    kv_gb = _kv_gb(model, args)
    routing: dict[str, list[dict]] = {"prefix": [], "round-robin": []}
    for r in range(args.rounds if "routing" in args.parts else 0):
        order = ("prefix", "round-robin") if r % 2 == 0 else ("round-robin", "prefix")
        for policy in order:
            extra = ["--attention", "2", "--routing", policy, "--kv-cache-gb", f"{kv_gb:.4f}"]
            proc, url = _serve(model, args, extra)
            try:
                s = _load(url, args, args.prefixes)
                per_server = _server_hit_rates(url)
            finally:
                _stop(proc)
            routing[policy].append(
                {"hit_rate": s["prefix_cache_hit_rate"], "ttft_p50_s": s["ttft_s"]["p50"],
                 "server_hit_rates": per_server}
            )  # fmt: skip
    return {
        "bench": "prefix",
        "cpu": _cpu(),
        "model": str(model),
        "setup": {
            k: getattr(args, k)
            for k in (
                "system_len",
                "questions",
                "question_len",
                "output_len",
                "concurrency",
                "rounds",
                "prefixes",
                "kv_prefixes",
            )
        },  # fmt: skip
        "caching": _caching_summary(caching) if caching["on"] else None,
        "routing": {
            **routing,
            "kv_cache_gb_per_server": round(kv_gb, 4),
            "hit_rate_prefix": _median(routing["prefix"], "hit_rate"),
            "hit_rate_round_robin": _median(routing["round-robin"], "hit_rate"),
        }
        if routing["prefix"]
        else None,
    }


def _caching_summary(caching: dict[str, list[dict]]) -> dict:
    on_p50, off_p50 = _median(caching["on"], "ttft_p50_s"), _median(caching["off"], "ttft_p50_s")
    return {
        **caching,
        "ttft_p50_on_s": on_p50,
        "ttft_p50_off_s": off_p50,
        "ttft_p50_speedup": off_p50 / on_p50,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix caching's TTFT and prefix-aware routing's hit rate")
    p.add_argument("--model", help="checkpoint with a tokenizer (default: the bench checkpoint)")
    p.add_argument("--system-len", type=int, default=1024, help="shared system prompt tokens")
    p.add_argument("--questions", type=int, default=64, help="distinct questions (requests)")
    p.add_argument("--question-len", type=int, default=32, help="tokens per question")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer")
    p.add_argument("--concurrency", type=int, default=4, help="streams at once")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each variant")
    p.add_argument("--prefixes", type=int, default=8, help="routing: distinct system prompts")
    p.add_argument(
        "--kv-prefixes",
        type=float,
        default=6.0,
        help="routing: prompts one server's KV holds beside its streams",
    )
    p.add_argument(
        "--parts",
        default="caching,routing",
        help="which comparisons to run, comma-separated: caching, routing",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.add_argument("--output", help="also write the JSON here")

    def main(a: argparse.Namespace) -> int:
        out = json.dumps(run(a), indent=2)
        if a.output:
            Path(a.output).write_text(out + "\n")
        print(out)
        return 0

    p.set_defaults(func=main)
