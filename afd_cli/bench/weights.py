"""`afd bench weights`: resident weight bytes of a block-FP8 checkpoint against its BF16 copy,
and (`--decode-batch`) their decode throughput.

For each service role (the attention side, one FFN shard holding every expert) and each copy,
a fresh process loads what that service loads and reports how much its resident set grew
(RSS after the load minus RSS before it, torch and afd already imported and the kernel path's
start-up measurement done); copies alternate,
`--repeat` times, medians reported with the FP8/BF16 ratio per role and in all. The FP8 copy is
written by `afd quantize --fp8-block` from the BF16 checkpoint (cached); `fp8_on_load` is the
BF16 checkpoint quantized as it loads (`--quantization fp8`). With `--decode-batch B ...`:
in-process engines of the BF16 and the FP8 copy decode the same prompts in turn at each batch
size (afd_cli/bench/variants.py), medians and the FP8/BF16 ratio; `fp8_head` is the FP8 copy
with its LM head quantized as it loads (`--quantize-lm-head`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from afd_cli.bench.context import checkpoint_path
from afd_cli.bench.engine import _cpu
from afd_cli.quantize import fp8_block

_CHILD = r"""
import gc, os, sys, torch
from afd.config import ExpertConfig, ModelConfig
from afd.sharding import ExpertShard
from services.attention.model import AttentionModel
from services.ffn.engine import FFNEngine

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

role, path, compute, quantization = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
cfg = ModelConfig.from_hf(path).with_quantization(quantization or None)
from afd.kernels import paths  # the kernel path and its start-up measurement: not weights
paths.active()
paths.onednn_from_rows(torch.get_num_threads())
gc.collect()
# What the measurement freed stays in glibc's heap (tune_allocator) and loading reuses it: an
# untrimmed baseline hid ~260 MB of the weights on an AMX box, where the measurement is largest.
from afd.runtime import release_load_memory
release_load_memory()
before = rss()
if role == "attention":
    held = AttentionModel(cfg, torch.bfloat16, progress=False)
else:
    held = FFNEngine(cfg, ExpertShard(0, 1, cfg.num_experts), torch.bfloat16, progress=False,
                     experts=ExpertConfig(compute=compute))
gc.collect()
print(rss() - before)
"""


def resident(role: str, path: Path, compute: str = "auto", quantization: str = "") -> int:
    """Bytes the resident set of a fresh process grows by when it loads `role`'s weights
    (`compute`: how an FFN shard multiplies MXFP4 experts; `quantization`: as --quantization)."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, role, str(path), compute, quantization],
        check=True,
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PATH": ""},
    )
    return int(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    cache = Path(args.cache_dir)
    bf16 = Path(args.model) if args.model else checkpoint_path(cache, "mla", 512, args.experts)
    fp8 = cache / f"{bf16.name}-fp8"
    if not (fp8 / "config.json").is_file():
        fp8_block(bf16, fp8, (128, 128), progress=False)
    copies = {"bf16": (bf16, ""), "fp8": (fp8, ""), "fp8_on_load": (bf16, "fp8")}
    runs: dict[tuple[str, str], list[int]] = {}
    for _ in range(args.repeat):
        for role in ("attention", "ffn"):
            for name, (path, q) in copies.items():
                runs.setdefault((role, name), []).append(resident(role, path, quantization=q))
    med = {key: int(statistics.median(v)) for key, v in runs.items()}

    def summary(bytes_of) -> dict:
        b = {name: bytes_of(name) for name in copies}
        return {
            **{f"{name}_bytes": v for name, v in b.items()},
            **{f"{name}_ratio": round(b[name] / b["bf16"], 3) for name in b if name != "bf16"},
        }

    roles = {role: summary(lambda n, r=role: med[(r, n)]) for role in ("attention", "ffn")}
    out = {
        "benchmark": "resident_weights",
        "cpu": _cpu(),
        "model": str(bf16),
        "fp8_model": str(fp8),
        "repeat": args.repeat,
        "roles": roles,
        "total": summary(lambda n: med[("attention", n)] + med[("ffn", n)]),
        "runs": {f"{r}/{n}": v for (r, n), v in runs.items()},
    }
    if args.decode_batch:
        import torch

        from afd.config import ModelConfig
        from afd.kernels import paths
        from afd_cli.bench.variants import decode_table, engine_config

        torch.set_num_threads(args.threads)
        configs = {
            "bf16": engine_config(bf16, args.threads),
            "fp8": engine_config(fp8, args.threads),
            # the LM head in FP8 too (--quantize-lm-head), as it loads
            "fp8_head": engine_config(fp8, args.threads, lm_head=True),
        }
        args.batch = args.decode_batch
        out["kernels"] = paths.active().name
        out["threads"] = args.threads
        out["decode"] = decode_table(configs, ModelConfig.from_hf(bf16).vocab_size, args)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("weights", help="resident bytes of block-FP8 weights vs their BF16 copy")
    p.add_argument("--model", help="a BF16 checkpoint (default: afd bench context's MLA model)")
    p.add_argument(
        "--experts",
        type=int,
        default=16,
        help="routed experts per layer of the default model (DeepSeek-V3 has 256)",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--decode-batch",
        type=int,
        nargs="*",
        default=[],
        help="also decode tok/s of both copies at these batch sizes (in-process engines, in turn)",
    )
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.set_defaults(func=lambda a: print(json.dumps(run(a), indent=2)) or 0)
