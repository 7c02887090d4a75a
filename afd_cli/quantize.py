"""`afd quantize`: write a copy of a checkpoint with its matmul weights quantized.

`--fp8-block`: DeepSeek's block-FP8 format, for any family afd serves: every matmul weight
(attention projections, experts, shared expert, dense MLPs; not embeddings, LM head, norms or
routers) as e4m3 with a float32 `weight_scale_inv` per block, and `quantization_config` in
config.json, so afd (and other engines that read DeepSeek's checkpoints) load it.
`--mxfp4`: the routed experts (most of an MoE model's bytes) in gpt-oss's MXFP4 layout, for any
family: each expert matrix [out, in] as `{name}_blocks` [out, in/32, 16] (two e2m1 values a
byte) and `{name}_scales` [out, in/32] (e8m0), round-to-nearest-even within each 32-value
block whose power-of-two scale fits its largest magnitude (afd/mxfp4.py); everything else as it
was. One shard is held at a time, never the whole model.
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

from afd import mxfp4
from afd.blockfp8 import covers, quantize_blocks
from afd.checkpoint import bars, strip_prefix, tensor_files
from afd.config import ModelConfig
from afd.errors import ConfigError
from afd.families import family


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("quantize", help="write a quantized copy of a checkpoint")
    fmt = p.add_mutually_exclusive_group(required=True)
    fmt.add_argument(
        "--fp8-block",
        action="store_true",
        help="DeepSeek's block-FP8: e4m3 weights, a float32 scale per block",
    )
    fmt.add_argument(
        "--mxfp4",
        action="store_true",
        help="gpt-oss's MXFP4 for the routed experts: 4-bit e2m1 values, a power-of-two scale "
        "per 32",
    )
    p.add_argument(
        "--block", default="128x128", help="--fp8-block's block rows x columns (default 128x128)"
    )
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
    return name is not None and covers(name, t)


def _canonical(cfg: ModelConfig, key: str) -> str | None:
    return family(cfg.model_type).weights.canonical(strip_prefix(key, cfg.weight_prefix))


def is_expert_matrix(cfg: ModelConfig, key: str, t: torch.Tensor) -> bool:
    """Whether a tensor holds routed-expert matrices (one expert's, or a stack of them)."""
    name = _canonical(cfg, key)
    return name is not None and ".experts." in name and not name.endswith("_bias") and t.dim() > 1


def _fp8(cfg: ModelConfig, key: str, t: torch.Tensor, block) -> dict[str, torch.Tensor]:
    if not quantizes(cfg, key, t):
        return {key: t}
    parts = [quantize_blocks(m, block) for m in (t if t.dim() == 3 else [t])]
    q = torch.stack([p[0] for p in parts]) if t.dim() == 3 else parts[0][0]
    s = torch.stack([p[1] for p in parts]) if t.dim() == 3 else parts[0][1]
    return {key: q, key + "_scale_inv": s}


def _mxfp4(cfg: ModelConfig, key: str, t: torch.Tensor, _block) -> dict[str, torch.Tensor]:
    if not is_expert_matrix(cfg, key, t):
        return {key: t}
    names = family(cfg.model_type).weights
    if names.stacked_transposed and not key.endswith(".weight"):
        t = t.transpose(-1, -2)  # gpt-oss keeps bf16 experts [E, in, out]; blocks run along in
    if t.shape[-1] % mxfp4.BLOCK:
        raise ConfigError(
            f"{key} has rows of {t.shape[-1]} values; MXFP4 needs a multiple of {mxfp4.BLOCK}"
        )
    rows = t.reshape(-1, t.shape[-1])
    blocks, scales = mxfp4.quantize(rows)
    lead = tuple(t.shape[:-1])
    return {
        key + "_blocks": blocks.view(*lead, *blocks.shape[1:]),
        key + "_scales": scales.view(*lead, scales.shape[1]),
    }


_FORMATS = {
    "fp8-block": (_fp8, "block-FP8"),
    "mxfp4": (_mxfp4, "MXFP4 experts"),
}


def write(src: Path, dst: Path, fmt: str, block=(128, 128), progress: bool = True) -> Path:
    """Write `src` quantized in `fmt` ("fp8-block" or "mxfp4") to the new directory `dst`."""
    convert, label = _FORMATS[fmt]
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
    bar = tqdm(total=len(files), desc=f"quantizing ({label})", unit="t", disable=not bars(progress))
    try:
        for shard in shards:
            out: dict[str, torch.Tensor] = {}
            with safe_open(str(shard), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    for name, t in convert(cfg, key, f.get_tensor(key), block).items():
                        out[name] = t.contiguous()
                        weight_map[name] = shard.name
                    bar.update(1)
            save_file(out, str(dst / shard.name), metadata={"format": "pt"})
            del out
    except ConfigError:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    bar.close()
    if len(shards) > 1 or (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for other in src.iterdir():  # tokenizer, generation config, ...
        if other.is_file() and not other.name.startswith("model.safetensors"):
            if other.suffix != ".safetensors" and other.name != "config.json":
                shutil.copy(other, dst / other.name)
    raw["quantization_config"] = _quantization_config(fmt, block)
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst


def _quantization_config(fmt: str, block) -> dict:
    if fmt == "mxfp4":
        # what gpt-oss's own checkpoints say: everything but the experts stays as it is
        keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]
        return {"quant_method": "mxfp4", "modules_to_not_convert": [*keep, "lm_head"]}
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


def fp8_block(src: Path, dst: Path, block: tuple[int, int], progress: bool = True) -> Path:
    return write(src, dst, "fp8-block", block, progress)


def run(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), Path(args.dst)
    fmt = "mxfp4" if args.mxfp4 else "fp8-block"
    out = write(src, dst, fmt, _block(args.block))
    print(f"{_FORMATS[fmt][1]} checkpoint written to {out}")
    return 0
