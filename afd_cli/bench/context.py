"""`afd bench context`: decode at long contexts for the attention kinds that differ there.

Three random-weight checkpoints of one size (written with transformers, cached): DeepSeek-V3
(MLA, latent KV cache), the same model with V3.2's sparse attention (DSA, `--index-topk`
tokens per query), and a GQA model of equal width (Qwen3-MoE, 4 K/V heads). For each context,
`--batch` sequences whose earlier tokens are already in the cache (random entries, as
`afd bench pipeline` fills them: only decode is timed) decode `--steps` steps in process, and
the run reports the step time, decode tok/s, its attention-side share (the step minus the FFN
waits) and the KV bytes per token. Models alternate within each repeat; medians are reported,
with the ratios: MLA against GQA (tok/s, KV bytes) and DSA against dense MLA (attention time).
Then MLA's prefill of one prompt per `--prefill-lengths`, in the absorbed form against afd's
choice (expanded from `expand_from` query rows on), alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd_cli.bench.engine import _cpu
from afd_cli.bench.pipeline import decode_steps
from afd_cli.local import local_engine
from services.attention.kinds import ATTENTION_KINDS

_COMMON = dict(
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_experts_per_tok=4,
    max_position_embeddings=32768,
    eos_token_id=None,
    bos_token_id=None,
)
_MLA = dict(
    n_routed_experts=16,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=256,
    q_lora_rank=512,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    num_key_value_heads=16,
)


def write_checkpoint(kind: str, path: Path, index_topk: int, experts: int = 16) -> Path:
    """A random-weight bf16 checkpoint of one attention kind (gqa, mla, dsa), written once."""
    import transformers as tf

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    if kind == "gqa":
        cfg = tf.Qwen3MoeConfig(
            **_COMMON, num_experts=16, num_key_value_heads=4, head_dim=64, mlp_only_layers=[0]
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind == "mla":
        mla = {**_MLA, "n_routed_experts": experts}
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**_COMMON, **mla))
    else:
        # the indexer in DeepSeek-V3.2's proportions: half as many heads as the attention,
        # each as wide as 64/544 of an absorbed head's key and value (V3.2: 128/1088)
        cfg = tf.DeepseekV32Config(
            **_COMMON, **_MLA, index_n_heads=8, index_head_dim=64, index_topk=index_topk
        )
        model = tf.DeepseekV32ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def checkpoint_path(cache: Path, kind: str, index_topk: int, experts: int = 16) -> Path:
    """The cached checkpoint of one kind, written on first use; the name changes with what
    the writer writes (v2: the indexer in V3.2's proportions)."""
    name = f"bench-context-v2-{kind}-{index_topk}" + (f"-e{experts}" if experts != 16 else "")
    return write_checkpoint(kind, cache / name, index_topk, experts)


def _measure(path: Path, batch: int, context: int, steps: int, threads: int) -> dict:
    mc = ModelConfig.from_hf(path)
    bs = 16
    blocks = batch * (-(-(context + steps + 2) // bs)) + 8
    cfg = EngineConfig(
        model=mc,
        dtype="bfloat16",
        a2f_dtype="bf16",
        threads=threads,
        cache=CacheConfig(block_size=bs, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_model_len=mc.max_position),
    )
    with local_engine(cfg, 1, progress=False) as eng:
        r = decode_steps(eng, batch, context, steps)
        layout = eng.cache.layout
    r["kv_bytes_per_token"] = layout.bytes_per_token(mc.num_layers, torch.bfloat16)
    return r


def _prefill_forms(path: Path, lengths: list[int], repeat: int, threads: int) -> list[dict]:
    """MLA prefill of one prompt per length, in the absorbed form and in afd's choice (the
    expanded form from `expand_from` rows), alternating; medians of `repeat`, in ms."""
    import time

    from afd.control import SamplingParams
    from afd_cli.local import local_engine
    from services.attention.kinds.mla import NEVER

    mc = ModelConfig.from_hf(path)
    top = max(lengths)
    cfg = EngineConfig(
        model=mc,
        dtype="bfloat16",
        a2f_dtype="bf16",
        threads=threads,
        cache=CacheConfig(block_size=16, num_blocks=top // 16 + 16),
        scheduler=SchedulerConfig(max_num_batched_tokens=top, max_model_len=mc.max_position),
    )
    out = []
    g = torch.Generator().manual_seed(0)
    with local_engine(cfg, 1, progress=False) as eng:
        kinds = [lw.kind for lw in eng.model.layers]
        chosen = kinds[0].expand_from
        for n in lengths:
            prompt = torch.randint(10, mc.vocab_size, (n,), generator=g).tolist()
            times: dict[str, list[float]] = {"absorbed_ms": [], "chosen_ms": []}
            for rep in range(repeat + 1):  # the first round warms up
                for name, start in (("absorbed_ms", NEVER), ("chosen_ms", chosen)):
                    for k in kinds:
                        k.expand_from = start
                    t = time.perf_counter()
                    eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
                    if rep:
                        times[name].append((time.perf_counter() - t) * 1e3)
            med = {k: round(statistics.median(v), 1) for k, v in times.items()}
            ratio = round(med["chosen_ms"] / med["absorbed_ms"], 2)
            out.append({"prompt": n, "expand_from": chosen, **med, "chosen_vs_absorbed": ratio})
    return out


def run(args: argparse.Namespace) -> dict:
    cache = Path(args.cache_dir)
    paths = {kind: checkpoint_path(cache, kind, args.index_topk) for kind in ("gqa", "mla", "dsa")}
    plan = [("gqa", c) for c in args.gqa_contexts] + [("mla", c) for c in args.mla_contexts]
    plan += [("dsa", c) for c in args.mla_contexts]
    runs: dict[tuple[str, int], list[dict]] = {p: [] for p in plan}
    for _ in range(args.repeat):
        for context in sorted({c for _, c in plan}):  # models alternate at each context
            for kind, c in plan:
                if c == context:
                    r = _measure(paths[kind], args.batch, c, args.steps, args.threads)
                    runs[(kind, c)].append(r)
    med = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()}
    results = [{"attention": kind, "context": c, **med[(kind, c)]} for kind, c in plan]
    c0 = args.mla_contexts[0]
    if c0 not in args.gqa_contexts:
        raise SystemExit("the first --mla-contexts must also be a --gqa-contexts")
    ratios = {
        "mla_vs_gqa_tok_s": {
            c: round(med[("mla", c)]["tok_s"] / med[("gqa", c)]["tok_s"], 2)
            for c in args.gqa_contexts
            if ("mla", c) in med
        },
        "mla_vs_gqa_kv_bytes": round(
            med[("mla", c0)]["kv_bytes_per_token"] / med[("gqa", c0)]["kv_bytes_per_token"], 3
        ),
        "dsa_vs_mla_attention_ms": {
            c: round(med[("dsa", c)]["A_ms"] / med[("mla", c)]["A_ms"], 2)
            for c in args.mla_contexts
        },
    }
    prefill = (
        _prefill_forms(paths["mla"], args.prefill_lengths, args.repeat, args.threads)
        if args.prefill_lengths
        else []
    )
    return {
        "benchmark": "context_decode",
        "cpu": _cpu(),
        "threads": args.threads,
        "batch": args.batch,
        "steps": args.steps,
        "index_topk": args.index_topk,
        "repeat": args.repeat,
        "attention_kinds": sorted(ATTENTION_KINDS),
        "results": results,
        "ratios": ratios,
        "mla_prefill": prefill,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("context", help="decode at long contexts: MLA vs GQA, DSA vs MLA")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--index-topk", type=int, default=512)
    p.add_argument("--gqa-contexts", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--mla-contexts", type=int, nargs="+", default=[1024, 2048, 8192, 16384])
    p.add_argument(
        "--prefill-lengths",
        type=int,
        nargs="*",
        default=[64, 256, 2048],
        help="MLA prefill, absorbed form vs afd's choice, at these prompt lengths",
    )
    p.add_argument("--repeat", type=int, default=3, help="alternating runs; medians reported")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.set_defaults(func=lambda a: print(json.dumps(run(a), indent=2)) or 0)
