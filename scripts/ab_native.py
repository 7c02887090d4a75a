"""Two revisions' native libraries in one engine, swapped between rounds: for a kernel change
whose effect is smaller than this box's spread between processes.

    python scripts/ab_native.py BEFORE AFTER [--batch 32] [--new-tokens 32] [--rounds 10]
        [--model CHECKPOINT] [--fast-from 50]

Each revision's `_native*.so` is built in a git worktree (as `scripts/ab_engine.py` builds
them); then one in-process engine of THIS checkout (the reference checkpoint, or `--model`;
bf16, 2 threads, the default kernel path; MXFP4 checkpoints on the direct path) loads its
weights once, and every round decodes with BEFORE's library, then AFTER's (the order flips
each round), every native call of the engine going to the round's library. Fresh processes
(ab_engine) each land in a different spell of the box's read rate; here both sides of a round
share one spell, the weights' pages and the engine's state. Each round also reads a 512 MiB
buffer (the box's read rate then): the JSON has every round, the ratio AFTER / BEFORE of
each, their median, and the medians of the rounds at or above `--fast-from` GB/s and below.

Only for revisions whose native functions take the arguments this checkout passes (the
argument types are this checkout's): a change to a kernel's body, not to its signature.
Not part of CI.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_engine import _git, _prepare  # noqa: E402  (scripts/ is not a package)

from afd_cli.bench.engine import _cpu, _read_bandwidth  # noqa: E402


def _load(so: Path, main: ctypes.CDLL, copy: Path) -> ctypes.CDLL:
    """`so` copied to `copy` and loaded beside this checkout's library (another file, so the
    loader does not hand back the first), with main's argument and result types on every
    function that main has configured."""
    shutil.copy(so, copy)
    lib = ctypes.CDLL(str(copy))
    for name, fn in list(vars(main).items()):
        if isinstance(fn, ctypes._CFuncPtr):
            other = getattr(lib, name)
            other.argtypes, other.restype = fn.argtypes, fn.restype
    return lib


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--model", help="the engine's checkpoint (default: the reference model)")
    p.add_argument("--fast-from", type=float, default=50.0, help="GB/s: a round read 'fast'")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    args = p.parse_args()

    from afd.config import CacheConfig, EngineConfig, ExpertConfig, ModelConfig, SchedulerConfig
    from afd.kernels import gemm
    from afd_cli.bench.engine import _afd_time, _decode_tps, _prompts, build_checkpoint
    from afd_cli.local import local_engine

    torch.set_num_threads(2)
    main_lib = gemm._lib()
    if main_lib is None:
        raise SystemExit("this checkout has no native library to compare (build it first)")
    path = (
        Path(args.model)
        if args.model
        else build_checkpoint(Path(args.cache_dir) / "bench-qwen3moe-ref")
    )
    model = ModelConfig.from_hf(path)
    revs = {"before": args.before, "after": args.after}
    shas = {k: _git("rev-parse", "--short", v).strip() for k, v in revs.items()}
    runs: dict[str, list[float]] = {"before": [], "after": []}
    reads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="afd-abn-") as root:
        trees: dict[str, Path] = {}
        try:
            for side, rev in revs.items():
                trees[side] = _prepare(rev, Path(root) / side)
            libs = {
                side: _load(next((tree / "afd" / "kernels").glob("_native*.so")), main_lib,
                            Path(root) / f"{side}.so")
                for side, tree in trees.items()
            }  # fmt: skip
        finally:
            for tree in trees.values():
                _git("worktree", "remove", "--force", str(tree))
        cfg = EngineConfig(
            model=model,
            dtype="bfloat16",
            a2f_dtype="bf16",
            threads=2,
            cache=CacheConfig(block_size=16, kv_cache_memory_gb=1.0),
            scheduler=SchedulerConfig(
                max_num_seqs=max(64, args.batch),
                max_num_batched_tokens=max(4096, args.batch * args.prompt_len),
            ),
            experts=ExpertConfig(compute="direct" if model.mxfp4_experts else "auto"),
        )
        buf = torch.ones(128 << 20)  # 512 MiB of fp32, far past the caches
        try:
            with local_engine(cfg, 1, progress=False) as eng:
                prompts = _prompts(args.batch, args.prompt_len, model.vocab_size, args.batch)

                def timed(p, n):
                    return _afd_time(eng, p, n)

                for lib in libs.values():  # each library's first calls, off the clock
                    gemm._lib = lambda lib=lib: lib
                    timed(prompts, 2)
                for r in range(args.rounds):
                    reads.append(_read_bandwidth(buf, 1))
                    for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                        gemm._lib = lambda lib=libs[side]: lib
                        runs[side].append(round(_decode_tps(timed, prompts, args.new_tokens), 1))
                    print(
                        f"round {r}: {reads[-1]:.1f} GB/s, before {runs['before'][-1]}, "
                        f"after {runs['after'][-1]} tok/s",
                        file=sys.stderr,
                    )
        finally:
            gemm._lib = lambda: main_lib
    ratios = [a / b for a, b in zip(runs["after"], runs["before"], strict=True)]
    fast = [x for x, rd in zip(ratios, reads, strict=True) if rd >= args.fast_from]
    slow = [x for x, rd in zip(ratios, reads, strict=True) if rd < args.fast_from]
    print(json.dumps({
        "benchmark": "ab_native",
        "cpu": _cpu(),
        "revisions": shas,
        "model": str(path),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "runs_tok_s": runs,
        "read_gb_s_runs": [round(v, 1) for v in reads],
        "after_over_before_runs": [round(v, 3) for v in ratios],
        "after_over_before": round(statistics.median(ratios), 3),
        "fast_rounds": {"count": len(fast), "median": round(statistics.median(fast), 3) if fast
                        else None},
        "slow_rounds": {"count": len(slow), "median": round(statistics.median(slow), 3) if slow
                        else None},
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
