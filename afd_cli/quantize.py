"""`afd quantize`: write a copy of a checkpoint with its matmul weights quantized.

`--fp8-block`: DeepSeek's block-FP8 format, for any family afd serves: every matmul weight
(attention projections, experts, shared expert, dense MLPs; not embeddings, LM head, norms or
routers) as e4m3 with a float32 `weight_scale_inv` per block, and `quantization_config` in
config.json, so afd (and other engines that read DeepSeek's checkpoints) load it. One shard is
held at a time, never the whole model.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from afd.blockfp8 import quantize_blocks
from afd.checkpoint import bars, strip_prefix, tensor_files
from afd.config import ModelConfig
from afd.errors import ConfigError
from afd.families import family

_KEEP = ("embed", "lm_head", "final_norm")  # canonical names left in high precision


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("quantize", help="write a quantized copy of a checkpoint")
    fmt = p.add_mutually_exclusive_group(required=True)
    fmt.add_argument(
        "--fp8-block",
        action="store_true",
        help="DeepSeek's block-FP8: e4m3 weights, a float32 scale per block",
    )
    p.add_argument("--block", default="128x128", help="block rows x columns (default 128x128)")
    p.add_argument("src", help="the checkpoint directory to read")
    p.add_argument("dst", help="the directory to write (must not exist)")
    p.set_defaults(func=run)
    return p


def _block(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--block {text!r} is not ROWSxCOLUMNS, e.g. 128x128") from None
    if min(rows, cols) < 1:
        raise ConfigError(f"--block {text!r} must be positive")
    return rows, cols


def quantizes(cfg: ModelConfig, key: str, t: torch.Tensor) -> bool:
    """Whether a tensor is a matmul weight that the FP8 format covers."""
    name = family(cfg.model_type).weights.canonical(strip_prefix(key, cfg.weight_prefix))
    if name is None or t.dim() not in (2, 3) or name in _KEEP:
        return False
    return not name.endswith((".router", ".router_bias", "norm"))


def fp8_block(src: Path, dst: Path, block: tuple[int, int], progress: bool = True) -> Path:
    cfg = ModelConfig.from_hf(src)
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config"):
        raise ConfigError(f"{src} is already quantized ({raw['quantization_config']!r})")
    if dst.exists():
        raise ConfigError(f"{dst} exists; afd quantize writes a new directory")
    files = tensor_files(src)
    shards = sorted(set(files.values()))
    dst.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = len(files)
    bar = tqdm(total=total, desc="quantizing", unit="t", disable=not bars(progress))
    for shard in shards:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                t = f.get_tensor(key)
                if quantizes(cfg, key, t):
                    parts = [quantize_blocks(m, block) for m in (t if t.dim() == 3 else [t])]
                    q = torch.stack([p[0] for p in parts]) if t.dim() == 3 else parts[0][0]
                    s = torch.stack([p[1] for p in parts]) if t.dim() == 3 else parts[0][1]
                    out[key], out[key + "_scale_inv"] = q, s
                    weight_map[key + "_scale_inv"] = shard.name
                else:
                    out[key] = t
                weight_map[key] = shard.name
                bar.update(1)
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})
        del out
    bar.close()
    if len(shards) > 1 or (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for other in src.iterdir():  # tokenizer, generation config, ...
        if other.is_file() and not other.name.startswith("model.safetensors"):
            if other.suffix != ".safetensors" and other.name != "config.json":
                shutil.copy(other, dst / other.name)
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst


def run(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), Path(args.dst)
    out = fp8_block(src, dst, _block(args.block))
    print(f"block-FP8 checkpoint written to {out}")
    return 0
