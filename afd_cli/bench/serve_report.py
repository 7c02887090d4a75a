"""`afd bench serve`'s results: one request's timings, and the run's summary and table."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server's prefix cache supplied (its usage)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {
        "mean": sum(xs) / len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
    }


def summarize(results: list[Result], duration: float, args: argparse.Namespace, model: str):
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    good = [
        r
        for r in ok
        if (not args.sla_ttft or r.ttft <= args.sla_ttft)
        and (not args.sla_tpot or r.tpot is None or r.tpot <= args.sla_tpot)
    ]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "model": model,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "concurrency": args.concurrency or None,
        "request_rate": args.request_rate or None,
        "duration_s": duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_prompt_tokens": cached,
        "prefix_cache_hit_rate": cached / in_tokens if in_tokens else 0.0,
        "request_throughput": len(ok) / duration if duration else math.nan,
        "output_throughput": out_tokens / duration if duration else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else math.nan,
        "sla": {"ttft_s": args.sla_ttft or None, "tpot_s": args.sla_tpot or None},
        "good_requests": len(good),
        "goodput": len(good) / duration if duration else math.nan,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats(tpots),
        "itl_s": _stats([g for r in ok for g in r.itl]),
        "e2e_s": _stats([r.e2e for r in ok]),
    }


def table(s: dict) -> str:
    rows = [
        ("requests (completed / failed)", f"{s['completed']} / {s['failed']}"),
        ("duration", f"{s['duration_s']:.2f} s"),
        ("request throughput", f"{s['request_throughput']:.2f} req/s"),
        ("output token throughput", f"{s['output_throughput']:.1f} tok/s"),
        ("total token throughput", f"{s['total_token_throughput']:.1f} tok/s"),
        ("prompt tokens cached", f"{s['cached_prompt_tokens']} ({s['prefix_cache_hit_rate']:.1%})"),
        ("goodput", f"{s['goodput']:.2f} req/s ({s['good_requests']} met the SLAs)"),
    ]
    lines = [f"afd bench serve: {s['model']} at {s['base_url']} ({s['endpoint']})"]
    lines += [f"  {k:<30} {v}" for k, v in rows]
    lines.append(f"  {'latency, ms':<30} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        st = s[key]
        vals = " ".join(f"{st[q] * 1e3:9.2f}" for q in ("mean", "p50", "p90", "p99"))
        lines.append(f"  {name:<30} {vals}")
    for e in s["errors"]:
        lines.append(f"  error: {e}")
    return "\n".join(lines)
