"""The embedded demo model: a small Step-3-shaped checkpoint with seeded random weights.

It exists so that `afd serve` works on a fresh machine with nothing downloaded. Its weights are
random, so the text it produces is meaningless; every use logs `DEMO_NOTICE` to say so.

The directory it writes is an ordinary Hugging Face `step3_text` checkpoint (config.json,
safetensors, byte-level tokenizer, chat template), so the same loading code serves it and a real
checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

log = logging.getLogger("afd.demo")

DEMO_NAME = "demo-step3-v2"  # bump the suffix whenever the weights or tokenizer change
SERVED_NAME = "afd-demo-step3"  # the demo model's name in the API
DEMO_SEED = 0
DEMO_INIT_STD = 0.06

DEMO_NOTICE = (
    "afd is serving its built-in demo model: a small Step-3-shaped network with seeded random "
    "weights. Its text is meaningless. To serve a real model, point afd at a local Hugging Face "
    "checkpoint directory: `afd serve --model /path/to/hf/checkpoint` "
    "(or `afd generate --model DIR`)."
)

BOS_TOKEN = "<|begin|>"
EOS_TOKEN = "<|end|>"
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)
NUM_BYTE_TOKENS = 256
BOS_TOKEN_ID = NUM_BYTE_TOKENS  # specials follow the 256 byte tokens, in SPECIAL_TOKENS order
EOS_TOKEN_ID = NUM_BYTE_TOKENS + 1
TOKENIZER_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Room for the tokenizer, padded so embedding rows stay a friendly multiple for kernels.
DEMO_VOCAB_SIZE = _round_up(TOKENIZER_SIZE, 64)

# The role tokens are hard-coded (not `bos_token`) so a plain jinja2 renderer, without the
# variables transformers injects, renders the same string. Tools, when a request lists them,
# are a system turn of one JSON definition per line, and an assistant's tool calls are written
# in the Hermes format that Qwen's templates use (`afd serve --tool-call-parser hermes`).
CHAT_TEMPLATE = (
    "{{- '<|begin|>' -}}"
    "{%- if tools -%}"
    "{{- '<|system|>You may call these tools. To call one, answer "
    '<tool_call>{"name": <name>, "arguments": <arguments as JSON>}</tool_call>.' + "' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{{- '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' -}}"
    "{{- (args if args is string else args | tojson) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["Step3TextForCausalLM"],
    "model_type": "step3_text",
    "vocab_size": DEMO_VOCAB_SIZE,
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_attention_groups": 1,
    "head_dim": 64,
    "share_q_dim": 256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embedding": 4096,
    "moe_num_experts": 32,
    "moe_top_k": 3,
    "moe_intermediate_size": 256,
    "intermediate_size": 1024,
    "share_expert_dim": 256,
    "norm_expert_weight": True,
    "moe_layers_enum": "1,2,3,4",  # layer 0 and the last layer stay dense, as in Step-3
    "tie_word_embeddings": False,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "bfloat16",
}

# A few-MB shape of the same family, for tests that need a real checkpoint quickly.
TINY_CONFIG: dict[str, Any] = {
    **DEMO_CONFIG,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 16,
    "share_q_dim": 32,
    "max_position_embedding": 512,
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "share_expert_dim": 32,
    "moe_layers_enum": "1",
}


# ---------------------------------------------------------------- tokenizer


def _byte_chars() -> list[str]:
    """The printable stand-in character of each byte value (index = byte).

    The ByteLevel pre-tokenizer and decoder map bytes to these characters (GPT-2's scheme), so the
    vocabulary must be keyed by them for every byte sequence to round-trip.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[int, int] = {b: b for b in printable}
    spare = 256
    for b in range(256):
        if b not in chars:
            chars[b] = spare
            spare += 1
    return [chr(chars[b]) for b in range(256)]


def build_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: ids 0..255 are the raw bytes, then SPECIAL_TOKENS in order."""
    vocab = {ch: b for b, ch in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.token_to_id(BOS_TOKEN) == BOS_TOKEN_ID and tok.get_vocab_size() == TOKENIZER_SIZE
    return tok


def write_tokenizer(out_dir: str | Path, model_max_length: int = 4096) -> int:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; return vocab size."""
    out = Path(out_dir)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,  # the chat template writes <|begin|> itself
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tok_config)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tok.get_vocab_size()


# ---------------------------------------------------------------- weights


def step3_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a step3_text checkpoint (HF names), in layer order."""
    c = config
    h, hd, qd = c["hidden_size"], c["head_dim"], c["share_q_dim"]
    kv = c.get("num_attention_groups", 1) * hd
    q = c["num_attention_heads"] * hd
    e, i_moe = c["moe_num_experts"], c["moe_intermediate_size"]
    moe_layers = _moe_layers(c)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (qd, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.inter_norm.weight"] = (qd,)
        shapes[p + "self_attn.wq.weight"] = (q, qd)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if layer in moe_layers:
            s = c.get("share_expert_dim", 0)
            shapes[p + "moe.gate.weight"] = (e, h)
            shapes[p + "moe.gate_proj.weight"] = (e, i_moe, h)
            shapes[p + "moe.up_proj.weight"] = (e, i_moe, h)
            shapes[p + "moe.down_proj.weight"] = (e, h, i_moe)
            if s:
                shapes[p + "share_expert.gate_proj.weight"] = (s, h)
                shapes[p + "share_expert.up_proj.weight"] = (s, h)
                shapes[p + "share_expert.down_proj.weight"] = (h, s)
        else:
            d = c["intermediate_size"]
            shapes[p + "mlp.gate_proj.weight"] = (d, h)
            shapes[p + "mlp.up_proj.weight"] = (d, h)
            shapes[p + "mlp.down_proj.weight"] = (h, d)
    shapes["model.norm.weight"] = (h,)
    if not c.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    return shapes


def _moe_layers(config: dict[str, Any]) -> set[int]:
    enum = config.get("moe_layers_enum")
    if enum is None:
        return set(range(1, config["num_hidden_layers"]))
    if isinstance(enum, str):
        return {int(x) for x in enum.split(",") if x.strip()}
    return {int(x) for x in enum}


def random_step3_weights(
    config: dict[str, Any], seed: int, init_std: float, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Seeded normal(0, init_std) weights; norm weights 1 + small noise so they are not no-ops.

    Embedding and LM-head rows past the tokenizer's size are zero."""
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    # One generator walked in a fixed (layer) order: identical tensors however they are sharded.
    for name, shape in step3_tensor_shapes(config).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.2 * init_std * noise
        else:
            t = init_std * noise
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            # rows past the tokenizer are padding: zero, so their logit (0) rarely wins and a
            # sampled id almost always decodes to text
            t[TOKENIZER_SIZE:] = 0.0
        weights[name] = t.to(dtype).contiguous()
    return weights


def _shard_groups(weights: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    """Split names, in order, into at most `shards` contiguous groups of similar byte size."""
    sizes = {n: t.numel() * t.element_size() for n, t in weights.items()}
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    before = 0
    for name, size in sizes.items():
        groups[min(shards - 1, before * shards // max(total, 1))].append(name)
        before += size
    return [g for g in groups if g]


def _write_weights(out: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    meta = {"format": "pt"}
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata=meta)
        return
    groups = _shard_groups(weights, shards)
    weight_map: dict[str, str] = {}
    for k, names in enumerate(groups, start=1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: weights[n] for n in names}, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


# ---------------------------------------------------------------- checkpoint directory


def write_step3_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    seed: int,
    init_std: float,
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 1,
) -> Path:
    """Write a complete HF-style step3_text directory with seeded random weights.

    Built in a temporary sibling directory and renamed into place, so a reader never sees a
    half-written checkpoint. Raises FileExistsError if `out_dir` exists and is not empty.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = _full_config(config, dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_tokenizer(tmp, model_max_length=cfg["max_position_embedding"])
        _write_weights(tmp, random_step3_weights(cfg, seed, init_std, dtype), shards)
        _write_json(tmp / "config.json", cfg)
        generation = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}
        _write_json(tmp / "generation_config.json", generation)
        (tmp / "README.md").write_text(_model_card(cfg, seed, init_std))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache should be readable like any dir
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if out.is_dir() and any(out.iterdir()):
            raise FileExistsError(f"{out} already exists and is not empty") from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _full_config(config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    cfg = {**config}
    cfg["model_type"] = "step3_text"
    cfg["vocab_size"] = max(int(cfg.get("vocab_size", 0)), DEMO_VOCAB_SIZE)
    cfg["bos_token_id"] = BOS_TOKEN_ID
    cfg["eos_token_id"] = EOS_TOKEN_ID
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    return cfg


def _model_card(cfg: dict[str, Any], seed: int, init_std: float) -> str:
    n_moe = len(_moe_layers(cfg))
    return f"""# afd demo model (step3_text, seeded random weights)

**The weights of this model are seeded random numbers (seed {seed}, normal std {init_std}).
It was never trained: the text it produces is meaningless.**

It exists so that afd can start, serve, stream and be tested on a machine with nothing
downloaded. It has the shape of Step-3 at toy scale: {cfg["num_hidden_layers"]} layers
({n_moe} MoE, the rest dense), hidden size {cfg["hidden_size"]}, {cfg["num_attention_heads"]}
query heads sharing one K/V head (MFA, low-rank query of rank {cfg["share_q_dim"]}),
{cfg["moe_num_experts"]} experts top-{cfg["moe_top_k"]} plus a shared expert, and a byte-level
tokenizer (256 byte tokens + {", ".join(SPECIAL_TOKENS)}).

## Serving a real model

Point afd at a local Hugging Face checkpoint directory (config.json + safetensors + tokenizer):

```
afd serve --model /path/to/hf/checkpoint
afd generate --model DIR
```
"""


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _is_complete(path: Path) -> bool:
    # The directory only ever appears by rename of a finished build, so these two files
    # present means whole; the check guards against a hand-made or foreign directory.
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def default_cache_dir() -> Path:
    env = os.environ.get("AFD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "afd"


def demo_model_dir(cache_dir: str | None = None) -> Path:
    """The demo checkpoint directory, built on first use and cached.

    Safe when several processes race: each builds in its own temporary directory and renames it
    into place; a loser discards its copy and uses the winner's.
    """
    log.warning(DEMO_NOTICE)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    path = root / DEMO_NAME
    if _is_complete(path):
        return path
    log.info("building the demo model in %s", path)
    try:
        write_step3_checkpoint(path, DEMO_CONFIG, seed=DEMO_SEED, init_std=DEMO_INIT_STD)
    except FileExistsError as e:
        if not _is_complete(path):  # a leftover we did not write: refuse to guess
            raise FileExistsError(
                f"{path} exists but is not a complete demo model; delete it to rebuild"
            ) from e
    return path
