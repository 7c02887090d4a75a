"""Decode with the weights in 4 KiB pages against the same in 2 MiB pages, in one process,
alternating (afd/hugepages.py): the box's memory rate swings by 2x within minutes, more than
the effect, so the two sides take turns decode by decode instead of process by process.

    AFD_HUGE_PAGES=0 python scripts/ab_hugepages.py [--batch 1 32] [--rounds 8]

Two engines of `afd bench engine`'s model are built with huge pages off (the variable must
be 0: this script moves the second engine's memory itself); then the memory mapped while the
second one was built (new mappings, and the part of the heap it grew by) is moved into huge
pages with `hugepages.collapse`, as `back_loaded` moves a server's. Each round decodes on
each engine, reads a 512 MiB buffer in 4 KiB pages and one in 2 MiB pages (the box's read
rate both ways, torch's sum as `afd bench engine` measures it). Prints JSON: tok/s per side,
the paired ratios and their median, the read rates. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

import torch

from afd import hugepages
from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd_cli.bench.engine import (
    _afd_fn,
    _cpu,
    _decode_tps,
    _prompts,
    _read_bandwidth,
    build_checkpoint,
)
from afd_cli.local import local_engine

READ = 512 << 20


def _new_since(before: list[tuple[int, int]], after: list[tuple[int, int]]):
    """The address ranges of `after` that no range of `before` covered."""
    out = []
    for lo, hi in after:
        cut = [(a, b) for a, b in before if a < hi and b > lo]
        if not cut:
            out.append((lo, hi))
        for a, b in cut:  # a region that grew: its new part, on either side
            if lo < a:
                out.append((lo, a))
            if b < hi:
                out.append((b, hi))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    args = p.parse_args()
    if hugepages.enabled() != f"{hugepages.ENV}=0":
        print(f"run with {hugepages.ENV}=0 (and THP available): {hugepages.enabled()}")
        return 2
    torch.set_num_threads(2)
    path = build_checkpoint(Path(args.cache_dir) / "bench-qwen3moe-ref")
    cfg = EngineConfig(
        model=ModelConfig.from_hf(path),
        dtype="bfloat16",
        a2f_dtype="bf16",
        threads=2,
        cache=CacheConfig(block_size=16, kv_cache_memory_gb=1.0),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
    )
    small, big = torch.ones(READ // 4), torch.ones(READ // 4)
    out: dict = {"benchmark": "ab_hugepages", "cpu": _cpu(), "results": []}
    with ExitStack() as stack:
        small_pages = stack.enter_context(local_engine(cfg, 1, progress=False))
        before = hugepages.anonymous_regions()
        huge_pages = stack.enter_context(local_engine(cfg, 1, progress=False))
        new = _new_since(before, hugepages.anonymous_regions())
        new.append((big.data_ptr(), big.data_ptr() + READ))
        _, moved, _ = hugepages.collapse(new, hugepages._libc())
        out["moved_gib"] = round(moved / 2**30, 2)
        sides = {"4k": _afd_fn(small_pages, "auto"), "2m": _afd_fn(huge_pages, "auto")}
        reads: dict[str, list[float]] = {"4k": [], "2m": []}
        for batch in args.batch:
            prompts = _prompts(batch, 16, 32000, batch)
            for fn in sides.values():
                fn(prompts[:1], 2)
            runs: dict[str, list[float]] = {k: [] for k in sides}
            for _ in range(args.rounds):
                for k, fn in sides.items():
                    runs[k].append(_decode_tps(fn, prompts, args.new_tokens))
                reads["4k"].append(_read_bandwidth(small))
                reads["2m"].append(_read_bandwidth(big))
            ratios = [b / a for a, b in zip(runs["4k"], runs["2m"], strict=True)]
            row = {
                "batch": batch,
                "tok_s": {k: [round(v, 1) for v in r] for k, r in runs.items()},
                "median_tok_s": {k: round(statistics.median(r), 1) for k, r in runs.items()},
                "huge_over_small_median_of_pairs": round(statistics.median(ratios), 3),
            }
            out["results"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        out["read_gb_s"] = {k: [round(v, 1) for v in r] for k, r in reads.items()}
        pairs = [b / a for a, b in zip(reads["4k"], reads["2m"], strict=True)]
        out["read_2m_over_4k_median_of_pairs"] = round(statistics.median(pairs), 3)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
