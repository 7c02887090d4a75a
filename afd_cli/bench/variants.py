"""Several in-process engines of one model (bf16, and its quantized copies or compute paths)
decoding the same prompts in turn: `afd bench mxfp4` and `afd bench weights`' decode figures.

Each batch size: a warm-up, then `repeat` rounds in which every variant decodes once (the
box's read rate recorded at each round's start, since decode is bound by it and it moves
between runs), medians per variant and each one's ratio to `base`'s.
"""

from __future__ import annotations

import json
import statistics
from contextlib import ExitStack
from pathlib import Path

import torch


def engine_config(path: Path, threads: int, compute: str = "auto", workspace_mb: float = 0.0,
                  quantization: str | None = None, lm_head: bool = False):  # fmt: skip
    """The engine every variant runs: bf16, 2 threads as `afd bench engine`, one micro-batch
    (quantization, lm_head: as --quantization and --quantize-lm-head)."""
    from afd.config import CacheConfig, EngineConfig, ExpertConfig, ModelConfig, SchedulerConfig

    experts = ExpertConfig(
        compute=compute, **({"workspace_mb": workspace_mb} if workspace_mb else {})
    )
    return EngineConfig(
        model=ModelConfig.from_hf(path).with_quantization(quantization, lm_head),
        dtype="bfloat16",
        a2f_dtype="bf16",
        threads=threads,
        cache=CacheConfig(block_size=16, kv_cache_memory_gb=0.5),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        experts=experts,
    )


def decode_table(configs: dict, vocab: int, args, base: str = "bf16") -> list[dict]:
    """configs: variant -> EngineConfig; args: batch, prompt_len, new_tokens, repeat. One row a
    batch size (printed as it is measured)."""
    from afd_cli.bench.engine import _afd_time, _decode_tps, _prompts, _read_bandwidth
    from afd_cli.local import local_engine

    results = []
    read_buf = torch.ones(128 << 20)  # larger than any cache
    with ExitStack() as stack:
        engines = {
            name: stack.enter_context(local_engine(cfg, 1, progress=False))
            for name, cfg in configs.items()
        }
        for batch in args.batch:
            prompts = _prompts(batch, args.prompt_len, vocab, batch)
            sides = {
                name: (lambda e: lambda p, n: _afd_time(e, p, n))(eng)
                for name, eng in engines.items()
            }
            for fn in sides.values():
                fn(prompts, 2)  # warm-up (and a workspace's first conversions)
            runs: dict[str, list[float]] = {name: [] for name in sides}
            reads: list[float] = []
            for _ in range(args.repeat):
                reads.append(_read_bandwidth(read_buf))
                for name, fn in sides.items():
                    runs[name].append(_decode_tps(fn, prompts, args.new_tokens))
            med = {name: statistics.median(v) for name, v in runs.items()}
            row = {
                "batch": batch,
                "tok_s": {name: round(v, 1) for name, v in med.items()},
                f"ratio_to_{base}": {
                    name: round(med[name] / med[base], 2) for name in med if name != base
                },
                "runs": {name: [round(v, 1) for v in r] for name, r in runs.items()},
                "read_gb_s_runs": [round(v, 1) for v in reads],
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    return results
