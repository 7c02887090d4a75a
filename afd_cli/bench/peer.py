"""`afd bench peer`: afd against llama.cpp's `llama-server` on the same checkpoint and workload.

    afd bench peer                    # build (cached), convert (cached), serve both, compare

1. build: `llama-server` from the source that the llama-cpp-python sdist vendors
   (`pip download --no-deps llama-cpp-python==VERSION`, then cmake, Release, native CPU flags,
   which on an AVX-512 BF16 CPU is llama.cpp's AVX512_BF16 build); ~10 min on 2 cores, kept in
   the cache directory. Quantized weights on a CPU with AMX-INT8 take a second build with
   every instruction set but AMX (`needs_no_amx` says why);
2. convert: the benchmark checkpoint (afd bench engine's) to GGUF bf16 with the vendored
   convert_hf_to_gguf.py; with `--quant mxfp4` both servers get MXFP4 experts instead, each
   made by its own tool from the same bf16 weights: afd's by `afd quantize --mxfp4`, served
   with attention and LM head in 8 bits too (`--quantization fp8 --quantize-lm-head`: block-FP8
   as they load), llama.cpp's by the vendored `llama-quantize` as `MXFP4_MOE` (the rest Q8_0,
   the recipe llama.cpp offers for MXFP4 experts): both sides' other matmul weights 8-bit;
3. run: each server in turn, alone on the machine, started as its users start it (llama-server
   with one slot per stream and continuous batching; `afd serve` with its defaults), each with
   its weights in 2 MiB pages (afd does that itself, afd/hugepages.py; llama-server gets the
   same through `--load-mode none` and glibc's hugetlb tunable, faster than its default here,
   docs/benchmarks.md; unless `--llama-default-pages`), driven by
   `afd bench serve` with the same prompts, lengths and concurrency; alternating rounds, medians,
   and the ratio afd / llama-server per concurrency.

Not part of CI: it needs the network for the sdist (the package index only) and minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from afd import hugepages
from afd_cli.bench.llama_cpp import (
    AFD_ARGS,
    FORMATS,
    build,
    convert,
    log,
    needs_no_amx,
    quantized,
    weight_bytes,
)

VERSION = "0.3.36"
_SERVERS = ("afd", "llama.cpp")
# llama-server's weights read into its own buffers (not mapped from the file, whose page cache
# stays in 4 KiB pages) with glibc asking for huge pages as its heap grows
_LLAMA_HUGE_ARGS = ("--load-mode", "none")
_LLAMA_HUGE_ENV = {"GLIBC_TUNABLES": f"{hugepages.TUNABLE}=1"}


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s")


def _start(name: str, args: argparse.Namespace, server: Path, gguf: Path, ckpt: Path, port: int):
    slots = max(args.concurrency)
    if name == "llama.cpp":
        cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
        # one slot per stream, each with the context one request needs; continuous batching
        ctx = (args.input_len + args.output_len + 64) * slots
        cmd += ["-np", str(slots), "-c", str(ctx), "-t", str(args.threads), "-cb"]
        cmd += [] if args.llama_default_pages else list(_LLAMA_HUGE_ARGS)
        health = f"http://127.0.0.1:{port}/health"
    else:
        cmd = [sys.executable, "-m", "afd_cli", "serve", "--model", str(ckpt), "--port", str(port)]
        cmd += [*AFD_ARGS[args.quant], *args.afd_arg]
        health = f"http://127.0.0.1:{port}/ready"  # /health answers before the model is up
    huge = name == "llama.cpp" and not args.llama_default_pages
    env = {**os.environ, **_LLAMA_HUGE_ENV} if huge else None
    log(" ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)  # fmt: skip
    try:
        _wait_ready(health, proc, args.start_timeout)
    except BaseException:
        _stop(proc)
        raise
    return proc


def start_afd_serve(model: Path, extra: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    """`afd serve --model MODEL` with `extra` flags on a free port, once /ready answers: (its
    process, its base URL); stop it with `_stop`."""
    from afd_cli.cluster import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "afd_cli", "serve", "--model", str(model), "--port", str(port)]
    proc = subprocess.Popen([*cmd, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(f"{url}/ready", proc, timeout)
    except BaseException:
        _stop(proc)
        raise
    return proc, url


def bench_serve(url: str, *flags: str) -> dict:
    """One `afd bench serve --json` run against the API at `url` with `flags`: its JSON
    summary; a failed run or a failed request stops the benchmark with the cause."""
    cmd = [sys.executable, "-m", "afd_cli", "bench", "serve", "--json", "--no-progress"]
    done = subprocess.run([*cmd, "--base-url", f"{url}/v1", *flags], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"afd bench serve failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    if out["failed"]:
        raise SystemExit(f"{out['failed']} requests failed: {out['errors']}")
    return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _drive(port: int, concurrency: int, args: argparse.Namespace, seed: int = 0) -> dict:
    """One `afd bench serve` run against the server on `port`; its JSON summary. seed: the
    prompts' (each run its own, so neither server's prompt cache serves a measured prefill)."""
    cmd = [sys.executable, "-m", "afd_cli", "bench", "serve", "--json", "--ignore-eos"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}/v1", "--concurrency", str(concurrency)]
    cmd += ["--num-requests", str(max(args.requests_per_stream * concurrency, 4))]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--seed", str(seed)] + (["--logprobs", "1"] if args.logprobs else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"afd bench serve failed on port {port}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def held_bytes(ckpt: Path, quant: str) -> int:
    """The weight bytes `afd serve` holds for `ckpt` under --quant (AFD_ARGS' quantization)."""
    import torch

    from afd.checkpoint import load_weights
    from afd.config import ModelConfig

    eight = quant == "mxfp4"  # AFD_ARGS: --quantization fp8 --quantize-lm-head
    cfg = ModelConfig.from_hf(ckpt).with_quantization("fp8" if eight else None, lm_head=eight)
    held = {  # a tied head is the embedding's tensor: counted once
        id(w): w
        for role in ("attention", "ffn")
        for w in load_weights(cfg, role, torch.bfloat16, progress=False).values()
    }
    return sum(w.nbytes for w in held.values())


def run(args: argparse.Namespace) -> dict:
    from afd.kernels import paths
    from afd_cli.bench.engine import build_checkpoint

    cache = Path(args.cache_dir) / "peers"
    no_amx = needs_no_amx(args.quant)
    server = build(cache, args.version, args.jobs, no_amx)
    if args.build_only:
        return {"llama_server": str(server)}
    bf16_ckpt = build_checkpoint(Path(args.cache_dir) / "bench-qwen3moe-ref")
    ckpt, gguf = quantized(cache, server, convert(cache, args.version, bf16_ckpt), bf16_ckpt,
                           args.quant)  # fmt: skip
    import torch

    from afd_cli.bench.engine import _read_bandwidth

    # The box's read rate just before each measured run (the server idle): at one stream both
    # servers are bound by it, and it moves between spells (docs/benchmarks.md).
    read_buf = torch.ones(128 << 20)
    runs: dict[tuple[str, int], list[dict]] = {}
    reads: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeat):  # alternating: a slow spell hits both servers
        for name in _SERVERS:
            proc = _start(name, args, server, gguf, ckpt, args.port)
            try:
                for i, c in enumerate(args.concurrency):
                    # prompts never sent before to this server (each concurrency its own)
                    _drive(args.port, c, args, seed=2 * i + 1)  # warm-up at this concurrency
                    reads.setdefault((name, c), []).append(_read_bandwidth(read_buf, 1))
                    runs.setdefault((name, c), []).append(_drive(args.port, c, args, 2 * i))
            finally:
                _stop(proc)
    rows = []
    for c in args.concurrency:
        row: dict = {"concurrency": c}
        for name in _SERVERS:
            tps = [r["output_throughput"] for r in runs[(name, c)]]
            tpot = [r["tpot_s"]["mean"] * 1e3 for r in runs[(name, c)]]
            ttft = [r["ttft_s"]["p50"] * 1e3 for r in runs[(name, c)]]
            row[name] = {
                "output_tok_s": round(statistics.median(tps), 1),
                "mean_tpot_ms": round(statistics.median(tpot), 2),
                "p50_ttft_ms": round(statistics.median(ttft), 1),
                "runs_tok_s": [round(v, 1) for v in tps],
                "read_gb_s_runs": [round(v, 1) for v in reads[(name, c)]],
            }
        row["ratio"] = round(row["afd"]["output_tok_s"] / row["llama.cpp"]["output_tok_s"], 2)
        # llama.cpp's TTFT over afd's: above 1, afd answers first
        row["ttft_ratio"] = round(row["llama.cpp"]["p50_ttft_ms"] / row["afd"]["p50_ttft_ms"], 2)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {
        "benchmark": "peer_serve",
        "cpu": _cpu(),
        "kernels_runnable": list(paths.runnable()),
        "llama_cpp": {
            "source": f"llama-cpp-python=={args.version} vendor/llama.cpp",
            "server": str(server),
            "build": "every instruction set of this CPU but AMX (GGML_NATIVE=OFF)"
            if no_amx
            else "native (GGML_NATIVE=ON)",
            "gguf": gguf.name,
            "huge_pages": not args.llama_default_pages,
            "args": [] if args.llama_default_pages else list(_LLAMA_HUGE_ARGS),
            "env": {} if args.llama_default_pages else _LLAMA_HUGE_ENV,
        },  # fmt: skip
        "afd_args": [*AFD_ARGS[args.quant], *args.afd_arg],
        "afd_model": ckpt.name,
        "quant": args.quant,
        "weights": {n: FORMATS[args.quant][n] for n in _SERVERS},
        "weight_bytes": {"afd": weight_bytes(ckpt), "llama.cpp": weight_bytes(gguf)},
        # what afd's servers hold once loaded (attention and the head quantized as they load)
        "afd_held_bytes": held_bytes(ckpt, args.quant),
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "logprobs": args.logprobs,
            "threads": args.threads,
        },  # fmt: skip
        "repeat": args.repeat,
        "results": rows,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("peer", help="afd serve vs llama.cpp's llama-server, same workload")
    p.add_argument("--version", default=VERSION, help="llama-cpp-python sdist to build from")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs")
    p.add_argument("--build-only", action="store_true", help="build llama-server and stop")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--logprobs", action="store_true", help="ask both servers for logprobs")
    p.add_argument(
        "--quant",
        choices=sorted(FORMATS),
        default="bf16",
        help="both servers' weights: bf16, or MXFP4 experts (each server quantizing with its "
        "own tool)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t")
    p.add_argument("--afd-arg", action="append", default=[], help="extra `afd serve` argument")
    p.add_argument(
        "--llama-default-pages",
        action="store_true",
        help="llama-server with its weights mapped from the file (4 KiB pages), not in huge pages",
    )
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--repeat", type=int, default=2, help="alternating rounds; medians reported")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.set_defaults(func=lambda a: print(json.dumps(run(a), indent=2)) or 0)
