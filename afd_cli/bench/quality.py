"""`afd bench quality`: what a format costs in accuracy, measured through the API as a user
would: the perplexity of a local text scored by `afd serve` (completions with echo, logprobs
and max_tokens 0), for BF16 experts, MXFP4 experts (`afd quantize --mxfp4` of the same
checkpoint) and FP8 hidden states on the attention -> FFN wire, one server after the other.

Per variant: the perplexity over the text's tokens, and against the BF16 run the mean and
largest |difference| of the per-token log-probabilities and how often the most likely next
token agrees. The text is cut into windows of `--window` tokens, each scored on its own (its
first token has no logprob). On a random-weight model the perplexity itself means nothing;
the differences between formats are what is measured.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import httpx

from afd_cli.bench.peer import _stop, start_afd_serve

_DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _score(url: str, windows: list[list[int]]) -> list[tuple[float, str, str]]:
    """(logprob, token text, most likely token text) per scored token, in order."""
    out = []
    for w in windows:
        body = {"prompt": w, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:],
                               strict=True):  # fmt: skip
            out.append((v, tok, max(top, key=top.get)))
    return out


def run(args: argparse.Namespace) -> dict:
    from afd_cli.bench.engine import _cpu
    from afd_cli.bench.mxfp4 import build_gpt_oss
    from afd_cli.quantize import write

    cache = Path(args.cache_dir)
    bf16 = Path(args.model) if args.model else build_gpt_oss(cache / "bench-gpt-oss-1024")
    mx = cache / f"{bf16.name}-mxfp4"
    if not (mx / "config.json").is_file():
        write(bf16, mx, "mxfp4", progress=False)
    text = Path(args.text).read_text()
    variants = {
        "bf16": (bf16, ["--a2f-dtype", "bf16"]),
        "mxfp4_experts": (mx, ["--a2f-dtype", "bf16"]),
        "fp8_wire": (bf16, ["--a2f-dtype", "fp8"]),
    }
    scored: dict[str, list[tuple[float, str, str]]] = {}
    windows: list[list[int]] = []
    for name, (path, extra) in variants.items():
        proc, url = start_afd_serve(path, ["--transport", "inproc", *extra], args.start_timeout)
        try:
            if not windows:
                r = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60)
                ids = r.json()["tokens"][: args.max_tokens]
                windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
                windows = [w for w in windows if len(w) > 1]
            scored[name] = _score(url, windows)
        finally:
            _stop(proc)
        print(f"{name}: {len(scored[name])} tokens scored", file=sys.stderr, flush=True)
    base = scored["bf16"]
    report = {}
    for name, s in scored.items():
        lps = [v for v, _, _ in s]
        row = {"perplexity": round(math.exp(-statistics.fmean(lps)), 3)}
        if name != "bf16":
            d = [abs(a[0] - b[0]) for a, b in zip(s, base, strict=True)]
            row["mean_abs_dlogprob"] = round(statistics.fmean(d), 4)
            row["max_abs_dlogprob"] = round(max(d), 4)
            row["top1_agreement"] = round(
                sum(a[2] == b[2] for a, b in zip(s, base, strict=True)) / len(s), 4
            )
        report[name] = row
    return {
        "benchmark": "quality",
        "model": str(bf16),
        "text": str(args.text),
        "tokens_scored": len(base),
        "window": args.window,
        "cpu": _cpu(),
        "variants": report,
    }


def add_parser(sub) -> None:
    p = sub.add_parser(
        "quality", help="perplexity through the API: BF16 vs MXFP4 experts vs FP8 wire"
    )
    p.add_argument("--model", help="a BF16 checkpoint (default: afd bench mxfp4's model)")
    p.add_argument("--text", default=str(_DEFAULT_TEXT), help="the text to score")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--max-tokens", type=int, default=8192, help="score the text's first N tokens")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.set_defaults(func=lambda a: print(json.dumps(run(a), indent=2)) or 0)
