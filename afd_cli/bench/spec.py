"""`afd bench spec`: what n-gram speculative decoding buys the engine, against the same engine
without it, in one run (`--serve`: through the API, afd_cli/bench/spec_serve.py).

Both engines (in process, the benchmark checkpoint, `--threads`) decode the same requests,
alternating `--repeat` times; each side's decode tok/s is its median. Per batch size and
workload: the ratio, the drafts verified and kept (the acceptance rate) and the tokens a
request got per step. Three workloads: `greedy` (temperature 0), `sampled` (temperature 1) and
`rejected` (greedy, every draft made wrong on purpose: what verifying costs when nothing is
kept).

What drafts catch depends on the text. The benchmark checkpoint has random weights; its greedy
text falls into loops that n-gram drafts predict well, and its sampled text hardly repeats: read
the two as near the best and near the worst case of one model, not as what a trained model
writing prose would get (there the figure lies between, higher where the output quotes the
prompt: code edits, extraction, summaries).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch

WORKLOADS = {"greedy": 0.0, "sampled": 1.0, "rejected": 0.0}  # temperature


def _wrong(drafter):
    """`drafter` with each of its drafts replaced by another token (so none is kept)."""
    propose = drafter.propose

    def wrong(req, limit):
        return [t + 1 if t + 1 < 1000 else 10 for t in propose(req, limit)]

    drafter.propose = wrong
    return drafter


def _decode(engine, prompts: list[list[int]], new: int, temperature: float) -> dict:
    """Decode tok/s of one batch (from the step that gave every request its first token to the
    end) and the drafts verified and kept."""
    from afd.control import SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=temperature, seed=0, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in prompts]
    steps = drafted = kept = 0
    t0 = None
    while engine.has_unfinished():
        result = engine.step()
        drafted += result.drafts[1]
        kept += result.drafts[2]
        if t0 is None and all(r.output_token_ids for r in reqs):
            t0, steps = time.perf_counter(), 0
        else:
            steps += 1
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output_token_ids) - 1 for r in reqs)
    return {
        "tok_s": tokens / seconds,
        "drafted": drafted,
        "kept": kept,
        "tokens_per_step": tokens / max(1, steps) / len(reqs),
    }


def run(args: argparse.Namespace) -> dict:
    from afd.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )
    from afd_cli.bench.engine import REFERENCE_CONFIG, _cpu, _prompts, build_checkpoint
    from afd_cli.local import local_engine
    from services.attention.speculative import NgramDrafter

    torch.set_num_threads(args.threads)
    path = build_checkpoint(Path(args.cache_dir) / "bench-qwen3moe-ref")
    spec = SpeculativeConfig.from_dict(json.loads(args.speculative_config))
    cfg = EngineConfig(
        model=ModelConfig.from_hf(path),
        dtype="bfloat16",
        a2f_dtype="bf16",
        threads=args.threads,
        cache=CacheConfig(block_size=16, kv_cache_memory_gb=1.0),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
    )
    results = []
    with ExitStack() as stack:
        engines = {
            "plain": stack.enter_context(local_engine(cfg, 1, progress=False)),
            "spec": stack.enter_context(
                local_engine(replace(cfg, speculative=spec), 1, progress=False)
            ),
        }
        for batch in args.batch:
            prompts = _prompts(batch, args.prompt_len, REFERENCE_CONFIG["vocab_size"], batch)
            for workload, temperature in WORKLOADS.items():
                drafter = engines["spec"].scheduler.drafter
                if workload == "rejected":
                    engines["spec"].scheduler.drafter = _wrong(NgramDrafter(spec))
                for e in engines.values():  # warm-up
                    _decode(e, prompts[:1], 4, temperature)
                runs: dict[str, list[dict]] = {name: [] for name in engines}
                for _ in range(args.repeat):  # alternating, so slow spells hit both sides
                    for name, e in engines.items():
                        runs[name].append(_decode(e, prompts, args.new_tokens, temperature))
                med = {n: statistics.median(r["tok_s"] for r in rs) for n, rs in runs.items()}
                last = runs["spec"][-1]  # drafts are the same in every run (fixed seeds)
                row = {
                    "batch": batch,
                    "workload": workload,
                    "plain_tok_s": round(med["plain"], 1),
                    "spec_tok_s": round(med["spec"], 1),
                    "ratio": round(med["spec"] / med["plain"], 2),
                    "drafted": last["drafted"],
                    "kept": last["kept"],
                    "acceptance": round(last["kept"] / max(1, last["drafted"]), 3),
                    "spec_tokens_per_step": round(last["tokens_per_step"], 2),
                }
                if args.repeat > 1:
                    row["runs"] = {n: [round(r["tok_s"], 1) for r in rs] for n, rs in runs.items()}
                results.append(row)
                print(json.dumps(row), flush=True)
                engines["spec"].scheduler.drafter = drafter
    return {
        "benchmark": "speculative_decoding",
        "config": "qwen3_moe hidden 1024, 8 layers, 32 experts top-4, bf16 (random weights)",
        "speculative_config": json.loads(args.speculative_config),
        "cpu": _cpu(),
        "torch": torch.__version__,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "results": results,
    }


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "spec", help="n-gram speculative decoding against the same engine without it"
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="runs per side, alternating; medians")
    p.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4}',
        help="as afd serve takes it",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="through the API instead: afd serve with and without it, fresh each round "
        "(--repeat rounds), driven by afd bench serve at each --concurrency",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="with --serve")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.set_defaults(func=lambda a: print(json.dumps(_run(a), indent=2)) or 0)
    return p


def _run(args: argparse.Namespace) -> dict:
    if args.serve:
        from afd_cli.bench import spec_serve

        return spec_serve.run(args)
    return run(args)
