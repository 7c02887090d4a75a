"""Safetensors loading: each family's name map (afd/families) to afd's names, plus a role filter.

afd's canonical names (what the services index by):
  attention role: embed, lm_head, final_norm, layers.{i}.{attn_norm, ffn_norm, router,
                  router_bias, o_proj} and per attention kind
                  gqa: layers.{i}.{q_proj, k_proj, v_proj, q_norm, k_norm}, with biases
                       {q,k,v,o}_proj_bias and sink logits `sinks` where the model has them
                  mfa: layers.{i}.{q_proj, k_proj, v_proj, inter_norm, wq}
                  mla: layers.{i}.{q_proj or q_a_proj, q_a_norm, q_b_proj; kv_a_proj,
                       kv_a_norm, kv_b_proj}
                  dsa: mla's, and layers.{i}.{index_wq, index_wk, index_k_norm,
                       index_k_norm_bias, index_weights}
  ffn role:       layers.{i}.experts.{e}.{gate, up, down} (and {gate,up,down}_bias where the
                  model has them), layers.{i}.shared.{gate, up, down}, layers.{i}.mlp.{...}
How a family spells them is the family's business (its `WeightNames`); what is generic stays
here: finding the tensors, keeping those one role and shard need, checking their shapes.
Stacked expert tensors [E, ...] (Step-3) are split per expert so that a shard loads only its own.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from afd.blockfp8 import BlockFP8, covers, dense, quantize_blocks, take_rows
from afd.config import ModelConfig
from afd.errors import CheckpointError
from afd.families import family
from afd.mxfp4 import MXFP4
from afd.sharding import ExpertShard

log = logging.getLogger("afd.checkpoint")


@dataclass(frozen=True)
class _Entry:
    """Where one canonical tensor comes from: a file key, optionally one slice of a stack;
    `transpose`: a bare stacked matrix stored [in, out] (gpt-oss)."""

    name: str
    key: str
    stack_index: int | None = None
    transpose: bool = False


def bars(progress: bool) -> bool:
    """Whether to show progress bars: asked for, and not turned off by TQDM_DISABLE (which tqdm
    itself reads only when `disable` is not passed, and it always is here)."""
    return progress and os.environ.get("TQDM_DISABLE", "").lower() in ("", "0", "false")


def strip_prefix(key: str, prefix: str) -> str:
    for p in (prefix, "model.language_model.", "language_model."):
        if p and key.startswith(p):
            rest = key[len(p) :]
            return rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
    return key


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors or a sharded index."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from e
        files = {}
        for name, fname in weight_map.items():
            f = model_dir / fname
            if not f.is_file():
                raise CheckpointError(f"{index} names {fname}, which is missing from {model_dir}")
            files[name] = f
        return files
    if single.is_file():
        try:
            with safe_open(str(single), "pt") as f:
                return dict.fromkeys(f.keys(), single)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{single} is not a readable safetensors file: {e}") from e
    raise CheckpointError(f"{model_dir} holds no model.safetensors or model.safetensors.index.json")


def _plan(cfg: ModelConfig, files: dict[str, Path], want: Callable[[str], bool]) -> list[_Entry]:
    names = family(cfg.model_type).weights
    entries: list[_Entry] = []
    for key in files:
        # MXFP4 "{tensor}_blocks" (its "_scales" is read beside it) loads as "{tensor}"
        name = names.canonical(strip_prefix(key.removesuffix("_blocks"), cfg.weight_prefix))
        if name is None:
            continue
        # a bare stacked matrix (no ".weight", not MXFP4 blocks) in a transposed layout
        bare = not key.endswith((".weight", "_bias", "_blocks"))
        transpose = names.stacked_transposed and bare
        if ".experts.*." in name:  # stacked [E, ...]: one entry per expert, read as a slice
            for e in range(cfg.num_experts):
                one = name.replace("*", str(e))
                if want(_split_name(one, "gate")):
                    entries.append(_Entry(one, key, stack_index=e, transpose=transpose))
        elif want(name):
            entries.append(_Entry(name, key))
    return entries


def _split_name(name: str, part: str) -> str:
    """A fused interleaved gate/up tensor's name -> the name of its `part` ("gate" or "up")."""
    return name.replace(".gate_up", f".{part}")


def loaded_names(name: str) -> list[str]:
    """The canonical names one mapped tensor is loaded as: an interleaved gate/up matrix or
    bias (gpt-oss: rows alternate gate, up) becomes its gate rows and its up rows."""
    if ".gate_up" not in name:
        return [name]
    return [_split_name(name, "gate"), _split_name(name, "up")]


def _parts(name: str, t):
    """(canonical name, tensor) pairs of one loaded tensor (see loaded_names)."""
    names = loaded_names(name)
    if len(names) == 1:
        return [(name, t)]
    return [
        (names[0], take_rows(t, slice(0, None, 2))),
        (names[1], take_rows(t, slice(1, None, 2))),
    ]


def load_weights(
    cfg: ModelConfig,
    role: str,
    dtype: torch.dtype,
    shard: ExpertShard | None = None,
    progress: bool = True,
) -> dict[str, torch.Tensor | BlockFP8 | MXFP4]:
    """Load the tensors one role needs, converted to `dtype`, checked against `cfg`'s shapes.
    A block-FP8 weight (a `weight_scale_inv` beside it) stays FP8, as a `BlockFP8`; MXFP4
    experts (`*_blocks` with `*_scales`) stay MXFP4.

    role "attention": embeddings, attention, norms, router, LM head.
    role "ffn": the experts of `shard` (all if None), plus the shared expert and dense MLPs
    when the shard is responsible for them.
    """
    model_dir = Path(cfg.path)
    files = tensor_files(model_dir)
    expected = expected_shapes(cfg)
    shard = shard or ExpertShard(0, 1, cfg.num_experts)

    def want(name: str) -> bool:
        if name not in expected or _role_of(name) != role:
            return False
        if ".experts." in name:
            return shard.owns(int(name.split(".")[3]))
        if ".shared." in name or ".mlp." in name:
            return shard.owns_dense
        return True

    entries = _plan(cfg, files, want)
    out: dict[str, torch.Tensor | BlockFP8 | MXFP4] = {}
    handles: dict[Path, object] = {}
    desc = f"loading {role} weights"
    bar = tqdm(entries, desc=desc, unit="t", disable=not bars(progress), leave=False)
    try:
        for ent in bar:
            t = _read(handles, files, ent.key, ent.stack_index)
            if ent.key.endswith("_blocks"):  # MXFP4: e2m1 pairs, an e8m0 scale per 32 values
                scales_key = ent.key.removesuffix("_blocks") + "_scales"
                if scales_key not in files:
                    raise CheckpointError(f"tensor {ent.key!r} has no {scales_key!r} beside it")
                try:
                    t = MXFP4.from_checkpoint(t, _read(handles, files, scales_key, ent.stack_index))
                except ValueError as e:
                    raise CheckpointError(f"tensor {ent.key!r}: {e}") from e
            elif ent.transpose:
                t = t.t().contiguous()
            for name, part in _parts(ent.name, t):
                _check_shape(ent.key, name, part, expected, cfg)
                out[name] = _convert(name, part, ent, files, handles, cfg, dtype)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"reading weights from {model_dir} failed: {e}") from e
    if role == "attention" and cfg.tie_word_embeddings and "lm_head" not in out:
        embed = out.get("embed")  # the embedding stays as it is: rows are gathered, not read
        tied = cfg.quantize_lm_head and isinstance(embed, torch.Tensor)
        out["lm_head"] = _fp8_lm_head(embed, cfg) if tied else embed  # type: ignore[assignment]
    missing = sorted(n for n in expected if want(n) and n not in out)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"checkpoint {model_dir} is missing {len(missing)} tensors: {shown}")
    return out


def _check_shape(key: str, name: str, t, expected: dict, cfg: ModelConfig) -> None:
    if tuple(t.shape) != expected[name]:
        raise CheckpointError(
            f"tensor {key!r} has shape {tuple(t.shape)}, expected "
            f"{expected[name]} for {cfg.model_type} with this config.json"
        )


def _convert(
    name: str, t, ent: _Entry, files: dict, handles: dict, cfg: ModelConfig, dtype: torch.dtype
):
    """One checked tensor as the services keep it."""
    if isinstance(t, MXFP4):
        return t  # kept in 4 bits: services/ffn multiplies it directly or converts it on use
    scale_key = ent.key + "_scale_inv"
    if scale_key in files and cfg.weight_block is not None:
        scale = _read(handles, files, scale_key, ent.stack_index)
        try:
            w = BlockFP8.from_checkpoint(t, scale, cfg.weight_block)
        except ValueError as e:
            raise CheckpointError(f"tensor {ent.key!r}: {e}") from e
        # kept FP8 (dequantized run by run in each matmul) unless read as a whole
        return dense(w, dtype) if name.endswith(_DENSE) else w
    if cfg.quantize_on_load and covers(name, t):  # the numbers `afd quantize` would write
        w = BlockFP8.from_checkpoint(*quantize_blocks(t, cfg.weight_block), cfg.weight_block)
        return dense(w, dtype) if name.endswith(_DENSE) else w
    if cfg.quantize_lm_head and name == "lm_head":
        return _fp8_lm_head(t, cfg)
    if name.endswith(_FLOAT32):
        return t.float()
    return t.to(dtype)


def _fp8_lm_head(t: torch.Tensor, cfg: ModelConfig) -> BlockFP8:
    """The LM head [V, H] in block-FP8 (`--quantize-lm-head`), in the model's blocks."""
    return BlockFP8.from_checkpoint(*quantize_blocks(t, cfg.weight_block), cfg.weight_block)


# Kept in float32 whatever the compute dtype: a selection bias in bf16 would reorder experts
# whose scores differ by less than its rounding (as the reference keeps it); sink logits and
# router biases join softmaxes computed in float32.
_FLOAT32 = (".router_bias", ".sinks")


# FP8 weights that are read whole, not multiplied by rows: dequantized at load. MLA's kv_b_proj
# becomes per-head matrices for the absorbed form's batched matmuls (about a tenth of
# DeepSeek-V3's attention weights, under 1% of the model).
_DENSE = ("embed", ".kv_b_proj")


def _read(handles: dict, files: dict[str, Path], key: str, stack_index: int | None):
    fpath = files[key]
    if fpath not in handles:
        handles[fpath] = safe_open(str(fpath), "pt")
    h = handles[fpath]
    if stack_index is None:
        t = h.get_tensor(key)
    else:
        t = h.get_slice(key)[stack_index]  # one expert of a stacked [E, ...], not the stack
    # A tensor read as it is stored can be a view of the file's mapping. Kept, it would keep
    # the whole mapping alive, and with it every page loading touched (the originals of
    # tensors since concatenated or converted): an owned copy lets the mapping go.
    return t.clone() if _maps_file(t) else t


def _maps_file(t: torch.Tensor) -> bool:
    """Whether a tensor's storage is not one torch allocated (a file mapping)."""
    try:
        return t.untyped_storage().resizable() is False
    except RuntimeError:
        return True


def _role_of(name: str) -> str:
    return "ffn" if any(p in name for p in (".experts.", ".shared.", ".mlp.")) else "attention"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the config implies, with its shape."""
    H = cfg.hidden_size
    s: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab_size, H),
        "final_norm": (H,),
    }
    if not cfg.tie_word_embeddings:
        s["lm_head"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        b = f"layers.{i}"
        s[f"{b}.attn_norm"] = (H,)
        s[f"{b}.ffn_norm"] = (H,)
        _attention_shapes(s, cfg, b)
        if cfg.is_moe(i):
            s[f"{b}.router"] = (cfg.num_experts, H)
            if cfg.router in _BIASED_ROUTERS:
                s[f"{b}.router_bias"] = (cfg.num_experts,)
            for e in range(cfg.num_experts):
                _mlp_shapes(s, f"{b}.experts.{e}", H, cfg.moe_intermediate_size, cfg.expert_bias)
            if cfg.shared_expert_intermediate_size:
                _mlp_shapes(s, f"{b}.shared", H, cfg.shared_expert_intermediate_size)
        else:
            _mlp_shapes(s, f"{b}.mlp", H, cfg.intermediate_size)
    return s


def _attention_shapes(s: dict[str, tuple[int, ...]], cfg: ModelConfig, b: str) -> None:
    H, D = cfg.hidden_size, cfg.head_dim
    if cfg.mla is not None:
        m = cfg.mla
        q_out = cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank:
            s[f"{b}.q_a_proj"] = (m.q_lora_rank, H)
            s[f"{b}.q_a_norm"] = (m.q_lora_rank,)
            s[f"{b}.q_b_proj"] = (q_out, m.q_lora_rank)
        else:
            s[f"{b}.q_proj"] = (q_out, H)
        s[f"{b}.kv_a_proj"] = (m.kv_lora_rank + m.qk_rope_head_dim, H)
        s[f"{b}.kv_a_norm"] = (m.kv_lora_rank,)
        s[f"{b}.kv_b_proj"] = (cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        s[f"{b}.o_proj"] = (H, cfg.num_heads * m.v_head_dim)
        if cfg.indexer is not None:
            ix = cfg.indexer
            s[f"{b}.index_wq"] = (ix.n_heads * ix.head_dim, m.q_lora_rank)
            s[f"{b}.index_wk"] = (ix.head_dim, H)
            s[f"{b}.index_k_norm"] = (ix.head_dim,)
            s[f"{b}.index_k_norm_bias"] = (ix.head_dim,)
            s[f"{b}.index_weights"] = (ix.n_heads, H)
        return
    s[f"{b}.k_proj"] = (cfg.kv_size, H)
    s[f"{b}.v_proj"] = (cfg.kv_size, H)
    s[f"{b}.o_proj"] = (H, cfg.q_size)
    if cfg.attention == "mfa":
        s[f"{b}.q_proj"] = (cfg.q_lora_dim, H)
        s[f"{b}.inter_norm"] = (cfg.q_lora_dim,)
        s[f"{b}.wq"] = (cfg.q_size, cfg.q_lora_dim)
    else:
        s[f"{b}.q_proj"] = (cfg.q_size, H)
    if cfg.qk_norm:
        s[f"{b}.q_norm"] = (D,)
        s[f"{b}.k_norm"] = (D,)
    if cfg.attention_bias:
        for proj, n in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            s[f"{b}.{proj}_bias"] = (n,)
        s[f"{b}.o_proj_bias"] = (H,)
    if cfg.attention_sinks:
        s[f"{b}.sinks"] = (cfg.num_heads,)


def _mlp_shapes(
    s: dict[str, tuple[int, ...]], base: str, hidden: int, inter: int, bias: bool = False
) -> None:
    s[f"{base}.gate"] = (inter, hidden)
    s[f"{base}.up"] = (inter, hidden)
    s[f"{base}.down"] = (hidden, inter)
    if bias:
        s[f"{base}.gate_bias"] = (inter,)
        s[f"{base}.up_bias"] = (inter,)
        s[f"{base}.down_bias"] = (hidden,)


# Router kinds with a per-expert bias: a selection bias (DeepSeek) or the logits' (gpt-oss)
_BIASED_ROUTERS = ("sigmoid_group_topk", "topk_softmax")
