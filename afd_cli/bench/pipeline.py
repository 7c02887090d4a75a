"""`afd bench pipeline`: micro-batch pipelining across processes, 1 attention + 1 FFN process
over tcp, one thread each.

For each workload it runs decode steps with S = 1 (serial) and takes the stage times from the
replies' timing traces: attention A (step time minus the waits on the FFN), FFN compute F, and
transfer C (round trip minus the FFN server's own time). The ideal pipelined speedup is
(A + F + C) / max(A, F, C); S = 2 and S = 3 are then measured in the same run (`--repeat N`:
S = 1, 2, 3 in turn N times, the median run of each reported). The balanced
workload also runs the in-process engine (attention and FFN in one process, 2 threads) for the
"disaggregation costs nothing" comparison. Long contexts are filled synthetically (random K/V)
rather than prefilled: only decode is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd_cli.bench.engine import REFERENCE_CONFIG, build_checkpoint
from services.attention.engine import Engine
from services.attention.request import RequestStatus


def fill_decoding(engine: Engine, batch: int, context: int, new: int, seed: int) -> None:
    """Admit `batch` requests whose first `context - 1` tokens are already in the KV cache
    (random K/V, latents, indexer keys), as if prefilled: the next step decodes."""
    g = torch.Generator().manual_seed(seed)
    sched, bm = engine.scheduler, engine.blocks
    for _ in range(batch):
        prompt = torch.randint(10, engine.cfg.model.vocab_size, (context,), generator=g).tolist()
        req = engine.add_request(
            prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        )
        # Benchmark-only: move the request straight to running with its KV blocks in place.
        sched._waiting.remove(req)
        req.block_ids = bm.allocate(bm.blocks_needed(context))
        req.num_computed_tokens = context - 1
        req.status = RequestStatus.RUNNING
        sched._running.append(req)
    cache = engine.cache
    for pool in (*cache.k, *([] if cache.layout.v_in_k else cache.v), *cache.index):
        pool.normal_(0, 1, generator=g)


def decode_steps(engine: Engine, batch: int, context: int, steps: int) -> dict:
    """Decode `steps` steps of `batch` sequences at `context` tokens: the step time and its
    attention-side (A), FFN (F) and transfer (C) shares, from the replies' traces."""
    fill_decoding(engine, batch, context, steps + 2, seed=batch)
    engine.step()  # warm-up step
    a_wait = f_compute = transfer = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        for _addr, r in engine.step().timing.traces:
            tr = r.trace
            rtt = tr.a_recv - tr.a_send
            a_wait += rtt
            f_compute += tr.f_compute_end - tr.f_compute_start
            transfer += rtt - (tr.f_send - tr.f_recv)
    wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return {
        "step_ms": round(wall / steps * 1e3, 2),
        "tok_s": round(batch * steps / wall, 1),
        "A_ms": round((wall - a_wait) / steps * 1e3, 2),
        "F_ms": round(f_compute / steps * 1e3, 2),
        "C_ms": round(transfer / steps * 1e3, 2),
    }


def _ffn_process(model: Path, address: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "afd_cli",
        "--log-level",
        "WARNING",
        "ffn",
        "--model",
        str(model),
        "--listen",
        address,
        "--threads",
        "1",
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)


def _median_run(runs: list[dict]) -> dict:
    """The run with the median step time (the lower middle of an even count): its stage times
    belong to that step time."""
    return sorted(runs, key=lambda r: r["step_ms"])[(len(runs) - 1) // 2]


def _workload(
    base: EngineConfig, name: str, batch: int, context: int, steps: int, repeat: int
) -> dict:
    runs: dict[int, list[dict]] = {1: [], 2: [], 3: []}
    for _ in range(repeat):  # S = 1, 2, 3 in turn, so that a slow spell of the box hits all
        for S in runs:
            eng = Engine(replace(base, micro_batches=S), progress=False)
            runs[S].append(decode_steps(eng, batch, context, steps))
            eng.dispatcher.reset()
            del eng
    med = {S: _median_run(rs) for S, rs in runs.items()}
    serial = med[1]
    A, F, C = serial["A_ms"], serial["F_ms"], serial["C_ms"]
    out: dict = {"workload": name, "batch": batch, "context": context, "stages_S1": serial}
    out["ideal_speedup"] = round((A + F + C) / max(A, F, C), 3)
    for S in (2, 3):
        # stages overlap here, so only the FFN's compute per step is kept: it grows as
        # micro-batches shrink (each streams the layer's expert weights again)
        out[f"S{S}"] = {k: med[S][k] for k in ("step_ms", "tok_s", "F_ms")}
        out[f"speedup_S{S}"] = round(serial["step_ms"] / med[S]["step_ms"], 3)
        out[f"fraction_of_ideal_S{S}"] = round(out[f"speedup_S{S}"] / out["ideal_speedup"], 3)
    if repeat > 1:
        out["step_ms_runs"] = {f"S{S}": [r["step_ms"] for r in rs] for S, rs in runs.items()}
    return out


def run(args: argparse.Namespace) -> dict:
    from afd.transport import connect  # noqa: F401 - registers backends
    from afd_cli.local import local_engine

    torch.set_num_threads(1)
    path = build_checkpoint(Path(args.cache_dir) / "bench-qwen3moe-ref")
    mc = ModelConfig.from_hf(path)
    address = f"tcp://127.0.0.1:{args.port}"
    proc = _ffn_process(path, address)
    base = EngineConfig(
        model=mc,
        dtype="bfloat16",
        a2f_dtype=args.a2f_dtype,
        ffn_addresses=(address,),
        cache=CacheConfig(block_size=16, kv_cache_memory_gb=1.5),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        ffn_timeout_s=120.0,
    )

    try:
        # wait for the FFN process to load
        Engine(base, progress=False).replicas.wait_ready(120.0)
        results = [
            _workload(
                base, "short_context", args.batch, args.short_context, args.steps, args.repeat
            ),
            _workload(
                base,
                "balanced_long_context",
                args.batch,
                args.long_context,
                args.steps,
                args.repeat,
            ),
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    torch.set_num_threads(2)
    inproc = replace(base, micro_batches=1, threads=2)
    with local_engine(inproc, 1, progress=False) as eng:
        local = _median_run(
            [
                decode_steps(eng, args.batch, args.long_context, args.steps)
                for _ in range(args.repeat)
            ]
        )
    balanced = results[1]
    return {
        "benchmark": "pipeline",
        "transport": "tcp",
        "a2f_dtype": args.a2f_dtype,
        "threads_per_process": 1,
        "results": results,
        "inprocess_2threads_balanced": local,
        "disaggregated_S2_vs_inprocess": round(balanced["S2"]["tok_s"] / local["tok_s"], 3),
        "config": REFERENCE_CONFIG | {"note": "qwen3_moe reference config, bf16"},
    }


def add_parser(sub) -> None:
    p = sub.add_parser(
        "pipeline", help="1A1F over tcp: stage times, ideal and measured S=2/3 speedups"
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--short-context", type=int, default=160)
    p.add_argument("--long-context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--repeat", type=int, default=1, help="run S = 1, 2, 3 N times in turn, report medians"
    )
    p.add_argument("--a2f-dtype", default="fp8", choices=["fp8", "bf16"])
    p.add_argument("--port", type=int, default=5799)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.set_defaults(func=lambda a: print(json.dumps(run(a), indent=2)) or 0)
