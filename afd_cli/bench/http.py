"""`afd bench http`: what the HTTP gateway costs on top of the control plane.

Starts a local cluster (as `afd serve` does), then runs the same streaming requests twice at
each concurrency: straight to the attention server's control plane (the gateway's own client,
over its gRPC Session), and through the gateway's /v1/completions (SSE). Reports time to first
token (TTFT) and inter-token latency (ITL) of both, and the difference. Prompts are token ids,
sampling is greedy with ignore_eos, so both paths do identical engine work.

Both paths ask for logprobs (k = 0), so the gateway streams every token as it arrives even when
its text is part of an unfinished UTF-8 character; ITL is then the gap between consecutive
tokens on either path. The client runs on the same machine as the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from afd_cli.cluster import Cluster, ClusterConfig


def _summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {
        "mean": round(statistics.fmean(s) * 1e3, 3),
        "p50": round(s[len(s) // 2] * 1e3, 3),
        "p99": round(s[min(len(s) - 1, round(0.99 * (len(s) - 1)))] * 1e3, 3),
    }


async def _direct_stream(client, rid: str, prompt: list[int], n: int) -> Sample:
    from afd.control import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    async for ev in client.generate(rid, prompt, params):
        if ev.token_ids:
            arrivals.append((time.perf_counter(), len(ev.token_ids)))
    return _sample(t0, arrivals)


async def _http_stream(http, url: str, prompt: list[int], n: int) -> Sample:
    # logprobs=0 on both paths: the gateway then sends every token as it arrives, even one
    # whose text is an incomplete UTF-8 character (random weights produce plenty).
    body = {
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    async with http.stream("POST", f"{url}/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            k = len(choices[0]["logprobs"]["tokens"]) if choices and choices[0]["logprobs"] else 0
            if k:
                arrivals.append((time.perf_counter(), k))
    return _sample(t0, arrivals)


Sample = tuple[float, list[float]]  # (TTFT, inter-token gaps)


def _sample(t0: float, arrivals: list[tuple[float, int]]) -> Sample:
    """TTFT and one gap per token after the first (a k-token event counts as k equal gaps)."""
    gaps: list[float] = []
    for (prev, _), (t, k) in zip(arrivals, arrivals[1:], strict=False):
        gaps += [(t - prev) / k] * k
    return arrivals[0][0] - t0, gaps


async def _level(run_one, concurrency: int, requests: int) -> dict:
    """`requests` streams, at most `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with sem:
            return await run_one(i)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(requests)))
    return {
        "ttft_ms": _summary([r[0] for r in results]),
        "itl_ms": _summary([g for r in results for g in r[1]]),
        "seconds": round(time.perf_counter() - t0, 3),
    }


async def _measure(cluster: Cluster, args: argparse.Namespace) -> list[dict]:
    import httpx

    from services.gateway.client import AttentionClient

    client = AttentionClient(cluster.attention_addresses[0], generate_timeout_s=600)
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8)
    headers = {"Authorization": "Bearer bench"}
    prompt = [32 + (i * 7) % 90 for i in range(args.prompt_len)]  # printable ASCII bytes
    rows = []
    async with httpx.AsyncClient(limits=limits, timeout=600, headers=headers) as http:

        def direct(i: int):
            return _direct_stream(
                client, f"bench-{time.monotonic_ns()}-{i}", prompt, args.max_tokens
            )

        def gateway(i: int):
            return _http_stream(http, cluster.url, prompt, args.max_tokens)

        await _level(direct, 1, 2)  # warm-up: first-call costs out of the figures
        await _level(gateway, 1, 2)
        for c in args.concurrency:
            n = max(c, args.requests)
            d = await _level(direct, c, n)
            g = await _level(gateway, c, n)
            row = {
                "concurrency": c,
                "requests": n,
                "direct_grpc": d,
                "gateway_http": g,
                "overhead_ms": {
                    k: round(g[k]["mean"] - d[k]["mean"], 3) for k in ("ttft_ms", "itl_ms")
                },
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    await client.close()
    return rows


def run(args: argparse.Namespace) -> dict:
    cfg = ClusterConfig(
        model=args.model,
        attention=1,
        ffn=args.ffn,
        transport=args.transport,
        port=0,
        api_key="bench",
        threads=args.threads,
        engine_args=("--micro-batches", str(args.micro_batches)),
    )
    sink = open(args.log or os.devnull, "ab")
    with sink, Cluster(cfg, log_sink=sink) as cluster:
        cluster.wait_ready()
        rows = asyncio.run(_measure(cluster, args))
    return {
        "benchmark": "http_overhead",
        "model": cluster.model_name,
        "transport": args.transport,
        "ffn": args.ffn,
        "micro_batches": args.micro_batches,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(),
        "results": rows,
    }


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `afd bench http` on the bench subparsers; sets func."""
    p = sub.add_parser("http", help="gateway (HTTP/SSE) vs direct gRPC: TTFT and ITL")
    p.add_argument("--model", help="checkpoint directory (default: the demo model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests", type=int, default=8, help="streams per level (>= concurrency)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ffn", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--transport", default="tcp", choices=["tcp", "ipc", "grpc", "inproc"])
    p.add_argument("--threads", type=int, default=0, help="torch threads per server (0: auto)")
    p.add_argument("--log", help="append the cluster's logs to this file")
    p.set_defaults(func=lambda a: print(json.dumps(run(a), indent=2)) or 0)
    return p
