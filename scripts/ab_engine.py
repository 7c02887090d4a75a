"""Two revisions of afd, the same in-process decode benchmark, alternating: for a change whose
effect is smaller than this box's spread between commands (a kernel, a step's Python).

    python scripts/ab_engine.py BEFORE AFTER [--batch 32] [--new-tokens 64] [--rounds 3]
        [--prompt-len 16]
        [--model CHECKPOINT [--expert-compute direct]]

Each revision is checked out into a git worktree and its native library built there; every
round runs BEFORE then AFTER in a fresh process each (`afd bench engine`'s engine: the
reference checkpoint, bf16, 2 threads, the default kernel path), decode tok/s as that command
computes it; `--model` another checkpoint (e.g. `afd bench mxfp4`'s gpt-oss model or its MXFP4
copy, with the expert path of `--expert-compute`). With `--prefill LEN`: prefill instead of
decode, prompt tok/s of `--batch` new prompts of LEN tokens each (one output token; the median
of three calls, each with prompts the engine has not seen), in one step or, with
`--prefill-budget TOKENS`, in chunks of that many tokens. With `--serve STREAMS`: each
side's `afd serve` instead, started fresh for every run and driven through the API by `afd
bench serve` at `--temperature` (0, greedy, unless given; both revisions need
afd_cli.bench.peer). With `--matmul ROWS`: afd's matmul alone on the default path
(`AFD_KERNELS`), ROWS rows of x against a decode step's weights from DRAM (a layer's
expert-sized matrices and the LM head's, cycled), GB/s of weights read.
Prints JSON: the runs, the medians and AFTER / BEFORE. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from afd_cli.bench.engine import _cpu, _decode_tokens  # this checkout's, as `afd bench engine`

REPO = Path(__file__).resolve().parents[1]

# Run inside each worktree (its own afd on sys.path): the engine as `afd bench engine` builds it.
_TIMING = r"""
import json, resource, sys, time
from pathlib import Path
import torch
from afd.config import CacheConfig, EngineConfig, ExpertConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd_cli.bench.engine import _decode_tps, _prompts, build_checkpoint
from afd_cli.local import local_engine

batch, new, threads, cache = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model, compute, prefill = sys.argv[5], sys.argv[6], int(sys.argv[7])
prompt_len = int(sys.argv[8]) if len(sys.argv) > 8 else 16
budget = int(sys.argv[9]) if len(sys.argv) > 9 else 0
torch.set_num_threads(threads)
path = Path(model) if model else build_checkpoint(Path(cache) / "bench-qwen3moe-ref")
cfg = EngineConfig(model=ModelConfig.from_hf(path), dtype="bfloat16", a2f_dtype="bf16",
                   micro_batches=1, decode_stack=True, threads=threads,
                   cache=CacheConfig(block_size=16, kv_cache_memory_gb=1.0),
                   scheduler=SchedulerConfig(max_num_seqs=64,
                                             max_num_batched_tokens=budget or max(
                                                 4096, batch * prefill, batch * prompt_len)),
                   experts=ExpertConfig(compute=compute))
with local_engine(cfg, 1, progress=False) as eng:
    prompts = _prompts(batch, prompt_len, cfg.model.vocab_size, batch)
    def timed(p, n):
        t0 = time.perf_counter()
        eng.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t0
    timed(prompts, 2)
    if prefill:  # fresh prompts every call: prefix caching serves none of them
        timed(_prompts(batch, prefill, cfg.model.vocab_size, 1000), 1)
        t = sorted(timed(_prompts(batch, prefill, cfg.model.vocab_size, 1001 + i), 1)
                   for i in range(3))[1]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's peak
        print(json.dumps({"tok_s": batch * prefill / t, "peak_rss_mb": rss}))
    else:
        print(json.dumps({"tok_s": _decode_tps(timed, prompts, new)}))
"""


# Run inside each worktree: that tree's matmul, `rows` rows of x, over weights far larger than
# the caches (the shapes of an expert's two matrices and the LM head), the median of 5 passes.
_MATMUL = r"""
import json, statistics, sys, time
import torch
from afd.kernels import gemm, paths

rows, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
isa = paths.active().name
if isa not in gemm.ISAS:
    raise SystemExit(f"--matmul measures afd's own matmul; the default path here is {isa}")
g = torch.Generator().manual_seed(0)
shapes = [(1024, 1024)] * 48 + [(1024, 512)] * 48 + [(32000, 1024)] * 2
ws = [gemm.lay_out(torch.randn(s, generator=g).to(torch.bfloat16), isa) for s in shapes]
xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in (512, 1024)}
nbytes = sum(w.numel() * 2 for w in ws)
def one_pass():
    t0 = time.perf_counter()
    for w in ws:
        gemm.bf16_linear(xs[w.shape[1]], w, isa)
    return nbytes / (time.perf_counter() - t0) / 1e9
one_pass()
print(json.dumps({"gb_s": statistics.median(one_pass() for _ in range(5))}))
"""


# Run inside each worktree: `afd serve` of that tree on the reference checkpoint, driven by
# `afd bench serve` (its output tok/s), then stopped.
_SERVING = r"""
import json, subprocess, sys
from pathlib import Path
from afd_cli.bench.engine import build_checkpoint
from afd_cli.bench.peer import _stop, start_afd_serve

streams, new, cache, temperature = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
path = build_checkpoint(Path(cache) / "bench-qwen3moe-ref")
proc, url = start_afd_serve(path, [], 600)
try:
    cmd = [sys.executable, "-m", "afd_cli", "bench", "serve", "--json", "--ignore-eos",
           "--base-url", f"{url}/v1", "--concurrency", str(streams),
           "--num-requests", str(max(6 * streams, 6)), "--input-len", "16",
           "--output-len", str(new), "--seed", "0", "--temperature", temperature]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    print(json.dumps({"tok_s": json.loads(done.stdout)["output_throughput"]}))
finally:
    _stop(proc)
"""


def _git(*args: str, cwd: Path = REPO) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _prepare(rev: str, tree: Path) -> Path:
    _git("worktree", "add", "--detach", str(tree), rev)
    build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    done = subprocess.run(build, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        _git("worktree", "remove", "--force", str(tree))
        raise SystemExit(f"building {rev}'s native library failed:\n{done.stderr[-2000:]}")
    return tree


def _run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if args.serve:
        code = _SERVING
        argv = [str(args.serve), str(args.new_tokens), args.cache_dir, str(args.temperature)]
    elif args.matmul:
        code, argv = _MATMUL, [str(args.matmul), str(args.threads)]
    else:
        code = _TIMING
        argv = [str(args.batch), str(args.new_tokens), str(args.threads), args.cache_dir]
        argv += [args.model or "", args.expert_compute, str(args.prefill), str(args.prompt_len)]
        argv += [str(args.prefill_budget)]
    out = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=tree, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"the engine run in {tree.name} failed:\n{out.stderr[-2000:]}")
    # tok/s or GB/s, and a prefill's peak resident memory (MB)
    return {k: round(v, 1) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=_decode_tokens, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--serve",
        type=int,
        metavar="STREAMS",
        help="instead of the engine: each side's `afd serve` (default flags), driven by "
        "`afd bench serve` at this many streams (6 requests each)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="LEN",
        help="measure the engine's prefill of --batch prompts of LEN tokens instead of decode",
    )
    p.add_argument(
        "--prefill-budget",
        type=int,
        default=0,
        metavar="TOKENS",
        help="the engine's tokens a step (max_num_batched_tokens; a longer prompt is prefilled "
        "in chunks, as `afd serve`'s default 2048 does); 0: every prompt in one step",
    )
    p.add_argument(
        "--matmul",
        type=int,
        metavar="ROWS",
        help="instead of the engine: afd's matmul alone at ROWS rows of x, GB/s of weights read",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="with --serve: the requests' temperature (0: greedy)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--prompt-len", type=int, default=16, help="decode: each sequence's prompt (its context)"
    )
    p.add_argument("--model", help="the engine's checkpoint (default: the reference model)")
    p.add_argument("--expert-compute", default="auto", choices=("auto", "direct", "workspace"))
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    args = p.parse_args()
    revs = {"before": args.before, "after": args.after}
    shas = {k: _git("rev-parse", "--short", v).strip() for k, v in revs.items()}
    runs: dict[str, list[float]] = {"before": [], "after": []}
    rss: dict[str, list[float]] = {"before": [], "after": []}
    unit, key = ("GB/s", "gb_s") if args.matmul else ("tok/s", "tok_s")
    with tempfile.TemporaryDirectory(prefix="afd-ab-") as root:
        trees: dict[str, Path] = {}
        try:
            for side, rev in revs.items():  # inside the try: a failed build removes the others
                trees[side] = _prepare(rev, Path(root) / side)
            for _ in range(args.rounds):
                for side in ("before", "after"):
                    r = _run(trees[side], args)
                    runs[side].append(r[key])
                    if "peak_rss_mb" in r:
                        rss[side].append(r["peak_rss_mb"])
                    print(f"{side} {shas[side]}: {runs[side][-1]} {unit}", file=sys.stderr)
        finally:
            for tree in trees.values():
                _git("worktree", "remove", "--force", str(tree))
    med = {k: statistics.median(v) for k, v in runs.items()}
    measured = (
        "afd serve" if args.serve else "matmul" if args.matmul
        else "engine prefill" if args.prefill else "engine"
    )  # fmt: skip
    print(json.dumps({
        "benchmark": "ab_engine",
        "cpu": _cpu(),
        "revisions": shas,
        "measured": measured,
        "prompt_len": args.prefill if measured == "engine prefill" else args.prompt_len,
        **({"prefill_budget": args.prefill_budget} if measured == "engine prefill" else {}),
        **({"streams": args.serve} if args.serve else {"rows": args.matmul} if args.matmul
           else {"batch": args.batch}),
        **({"model": args.model, "expert_compute": args.expert_compute} if args.model else {}),
        **({} if args.matmul else {"new_tokens": args.new_tokens}),
        "threads": args.threads,
        f"runs_{key}": runs,
        f"median_{key}": med,
        "after_over_before": round(med["after"] / med["before"], 3),
        **({"runs_peak_rss_mb": rss} if rss["before"] else {}),
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
