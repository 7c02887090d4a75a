"""`afd bench mxfp4`: MXFP4 experts against the BF16 experts of the same model: the FFN
server's resident bytes, and decode throughput at each batch size on each compute path
(direct: afd's kernel reads the 4-bit weights; workspace: experts converted on use into a
shared pool), all measured in one run.

The default model is gpt-oss-shaped (the family MXFP4 comes with) and scaled to this box:
hidden 1024, 8 layers alternating sliding (128) and full attention, 32 experts of 1024, top-4,
a 32000 vocabulary, random bf16 weights (fixed seed); routed experts are two thirds of the
bytes a decode step reads, as in gpt-oss-20b. `--model` takes any BF16 checkpoint instead. Its
MXFP4 copy is written by `afd quantize --mxfp4` (cached). Resident
bytes: a fresh process per copy loads one FFN shard holding every expert and reports how much
its resident set grew (copies alternate, `--repeat` times, medians). Decode: in-process
engines (attention and FFN in one process, as `afd bench engine`), alternating, `--repeat`
times, medians, with the ratio to BF16 for each path, and `mxfp4_8bit`: the direct path with
attention and the LM head in block-FP8 as they load (`--quantization fp8 --quantize-lm-head`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

GPT_OSS_SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=4096,
    initializer_range=0.02,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def build_gpt_oss(path: Path, seed: int = 0) -> Path:
    from afd_cli.bench.engine import write_random_checkpoint

    return write_random_checkpoint(path, "GptOss", GPT_OSS_SHAPE, seed)


def run(args: argparse.Namespace) -> dict:
    from afd.config import ModelConfig
    from afd.kernels import paths
    from afd_cli.bench.engine import _cpu
    from afd_cli.bench.variants import decode_table, engine_config
    from afd_cli.bench.weights import resident as ffn_resident
    from afd_cli.quantize import write

    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir)
    bf16 = Path(args.model) if args.model else build_gpt_oss(cache / "bench-gpt-oss-1024")
    mx = cache / f"{bf16.name}-mxfp4"
    if not (mx / "config.json").is_file():
        write(bf16, mx, "mxfp4", progress=False)
    vocab = ModelConfig.from_hf(bf16).vocab_size

    variants = {  # name -> (checkpoint, expert compute)
        "bf16": (bf16, "auto"),
        "mxfp4_direct": (mx, "direct"),
        "mxfp4_workspace": (mx, "workspace"),
    }
    resident: dict[str, list[int]] = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, (path, compute) in variants.items():
            resident[name].append(ffn_resident("ffn", path, compute))
    res_med = {name: int(statistics.median(v)) for name, v in resident.items()}

    configs = {
        name: engine_config(p, args.threads, c, args.workspace_mb)
        for name, (p, c) in variants.items()
    }
    # decode only: MXFP4 experts with attention and the LM head in block-FP8 as they load
    # (--quantization fp8 --quantize-lm-head; the FFN server's bytes are mxfp4_direct's)
    configs["mxfp4_8bit"] = engine_config(
        mx, args.threads, "direct", args.workspace_mb, quantization="fp8", lm_head=True
    )
    results = decode_table(configs, vocab, args)
    return {
        "benchmark": "mxfp4_experts",
        "model": str(bf16),
        "mxfp4_model": str(mx),
        "cpu": _cpu(),
        "kernels": paths.active().name,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "workspace_mb": args.workspace_mb,
        "repeat": args.repeat,
        "ffn_resident_bytes": res_med,
        "ffn_resident_ratio": {
            name: round(res_med[name] / res_med["bf16"], 3) for name in res_med if name != "bf16"
        },
        "resident_runs": resident,
        "decode": results,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("mxfp4", help="MXFP4 experts vs BF16: FFN resident bytes and decode tok/s")
    p.add_argument("--model", help="a BF16 checkpoint (default: a gpt-oss-shaped model)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--workspace-mb",
        type=float,
        default=1024.0,
        help="the workspace path's pool (the default model's experts are 1.6 GB in bf16)",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.set_defaults(func=lambda a: print(json.dumps(run(a), indent=2)) or 0)
