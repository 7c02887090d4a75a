"""Issue 8's live acceptance: `afd plan --from-metrics` reads a live tiny cluster's /metrics and
recommends an attention:FFN ratio; the recommended ratio then decodes faster per server than a
deliberately unbalanced one on the same machine and load.

Both run S = 2 micro-batches (the comparison is of the ratio alone), one torch thread per
server, the same `afd bench serve` load (24 requests, 8 at a time, 16 prompt and 24 output
tokens); each is measured twice, interleaved, and its better run counts, so a burst of other
work on the machine cannot decide the outcome. Measured on 2-core development machines:
AVX-512: 1A1F (recommended, ratio ~1.1) 330-500 output tokens/s; 1A3F 285; 3A1F 230; 2A2F 220.
AVX2 (afd's own bf16 kernel): 2A1F (recommended, ratio ~1.6) 410-440; 1A3F 400; 1A2F 490.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from afd_cli.bench import serve as bench
from tests.system.metrics_helpers import serve

LOAD = ("--num-requests", "24", "--concurrency", "8", "--input-len", "16", "--output-len", "24")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("plan") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )


def _bench(url: str, *load: str) -> float:
    """Output tokens per second of one `afd bench serve` run (in this process: a subprocess
    would spend longer importing than the run takes)."""
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--base-url", url, *load, "--ignore-eos", "--no-progress"])
    s = asyncio.run(bench.run_async(args))
    assert s["failed"] == 0, s["errors"]
    return s["output_throughput"]


def _cluster(model, attention: int, ffn: int):
    # tcp: the ratio compared is of processes (auto would put the FFN inside on a small box)
    a, f = str(attention), str(ffn)
    return serve(model, "--attention", a, "--ffn", f, "--micro-batches", "2", "--transport", "tcp")


# A throughput comparison of live clusters (~50 s): a drill for the slow set, not a default test.
@pytest.mark.slow
def test_recommended_ratio_beats_an_unbalanced_one(model):
    base = _cluster(model, 1, 1)
    others = []
    try:
        _bench(base.url, "--num-requests", "8", "--concurrency", "8")  # warm-up
        first = _bench(base.url, *LOAD)
        sources = [u for name, u in base.metrics.items() if name != "gateway"]
        cmd = [sys.executable, "-m", "afd_cli", "plan", "--max-instances", "2", "--json"]
        out = subprocess.run(
            [*cmd, *[a for u in sources for a in ("--from-metrics", u)]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        plan = json.loads(out.stdout)
        rec = plan["recommendation"]
        x, y = rec["attention_servers"], rec["ffn_servers"]
        assert plan["measured"]["attention_layer_s"] > 0 and plan["measured"]["ffn_compute_s"] > 0
        # The deliberately unbalanced one leans the other way, three to one.
        ux, uy = (1, 3) if x >= y else (3, 1)
        shapes = [(ux, uy)] if (x, y) == (1, 1) else [(x, y), (ux, uy)]
        with ThreadPoolExecutor(2) as pool:  # start them side by side: half the waiting
            futures = [pool.submit(_cluster, model, *shape) for shape in shapes]
        others = [f.result() for f in futures if not f.exception()]
        for f in futures:
            f.result()  # raises the first start-up failure (the others are stopped below)
        recommended = others[0] if len(others) == 2 else base
        unbalanced = others[-1]
        _bench(unbalanced.url, "--num-requests", "8", "--concurrency", "8")  # warm-up
        rec_runs = [first] if recommended is base else []
        unb_runs = []
        for _ in range(2):
            rec_runs.append(_bench(recommended.url, *LOAD))
            unb_runs.append(_bench(unbalanced.url, *LOAD))
        # Per server: the planner ranks by cost, and every server here costs the same. (On this
        # 2-core box all servers share the cores, so the total of any topology is capped by the
        # box: 2A1F and 1A3F both measured ~400 tok/s, and 1A2F beat 2A1F by ~10%, as the
        # planner's model, where each server has hardware of its own, does not foresee.)
        r, u = max(rec_runs) / (x + y), max(unb_runs) / (ux + uy)
        print(
            f"\nplan: ratio {rec['ratio']:.2f} -> {x}A{y}F (S={rec['micro_batches']} advised); "
            f"throughput in tok/s {x}A{y}F (runs {[round(v) for v in rec_runs]}) vs "
            f"{ux}A{uy}F (runs {[round(v) for v in unb_runs]}); per server {r:.0f} vs {u:.0f}"
        )
        assert r > 1.1 * u, (rec_runs, unb_runs)
    finally:
        for c in [base, *others]:
            c.stop()
