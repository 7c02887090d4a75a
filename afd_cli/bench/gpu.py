"""`afd bench gpu`: afd on a CUDA device, measured against transformers on the same device in
the same run, and the Step-3-shaped MFA attention layer against the report's figure.

- decode: the benchmark checkpoint (afd bench engine's) at each batch, afd with attention and
  its in-process FFN shard on the GPU vs transformers' bf16 `generate` (its default attention
  implementation) on the same GPU; alternating runs, medians, the ratio per batch. Decode
  throughput excludes the prefill as `afd bench engine` does.
- mfa_layer: one Step-3 attention layer (hidden 7168, a 2048-wide low-rank query, 64 query
  heads of 256, one shared K/V head, bf16) decoding a batch of rows against a context each
  already in the paged KV cache: the whole layer (norms, projections, RoPE, the cache write,
  paged attention, o_proj) and the attention over the cache alone, each the median of CUDA-event
  timed repeats after a warm-up, over a bf16 and an FP8 KV cache, with the decode attention on
  each CUDA path (afd's Triton kernel, and torch's ops over gathered blocks); the bytes the
  bf16 layer reads over its best time are reported beside the device's measured copy
  bandwidth. The report's figure assumes an 8-bit KV cache (its arithmetic-intensity table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

# Step-3's attention shape (its config.json); the MoE part is kept tiny: only attention is timed
STEP3_ATTENTION = dict(
    hidden_size=7168,
    num_attention_heads=64,
    num_attention_groups=1,
    head_dim=256,
    share_q_dim=2048,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)
REPORT_MFA_US = 281.0  # the Step-3 report's MFA layer at batch 256, 8K context, on an H800


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _decode(args, device: torch.device) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from afd.control import SamplingParams
    from afd_cli.bench.engine import REFERENCE_CONFIG, _prompts, build_checkpoint
    from afd_cli.local import local_engine

    path = build_checkpoint(Path(args.cache_dir) / "bench-qwen3moe-ref")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    longest = args.prompt_len + args.new_tokens
    cfg = EngineConfig(
        model=ModelConfig.from_hf(path),
        dtype="bfloat16",
        device=str(device),
        a2f_dtype="bf16",
        cache=CacheConfig(block_size=16, num_blocks=max(args.batch) * (-(-longest // 16) + 1)),
        scheduler=SchedulerConfig(
            max_num_seqs=max(args.batch), max_num_batched_tokens=max(8192, args.prompt_len)
        ),
    )
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def afd_fn(engine):
        def run(prompts, new):
            sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            return _sync_time(lambda: engine.generate(prompts, sp))

        return run

    @torch.inference_mode()
    def hf_fn(prompts, new):
        ids = torch.tensor(prompts, device=device)
        return _sync_time(
            lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False)
        )  # fmt: skip

    rows = []
    with local_engine(cfg, 1, progress=False) as engine:
        engine.generate([[5, 6, 7]], greedy)  # warm-up: allocator, kernels' first launches
        sides = {"afd": afd_fn(engine), "transformers_bf16": hf_fn}
        for batch in args.batch:
            prompts = _prompts(batch, args.prompt_len, REFERENCE_CONFIG["vocab_size"], batch)
            for fn in sides.values():
                fn(prompts[:2], 2)
            runs: dict[str, list[float]] = {n: [] for n in sides}
            for _ in range(args.repeat):
                for name, fn in sides.items():
                    t1, tn = fn(prompts, 1), fn(prompts, args.new_tokens)
                    runs[name].append(batch * (args.new_tokens - 1) / max(tn - t1, 1e-9))
            med = {n: statistics.median(v) for n, v in runs.items()}
            row = {
                "batch": batch,
                "afd_tok_s": round(med["afd"], 1),
                "transformers_tok_s": round(med["transformers_bf16"], 1),
                "ratio": round(med["afd"] / med["transformers_bf16"], 2),
                "runs": {n: [round(x, 1) for x in v] for n, v in runs.items()},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _event_us(fn, repeat: int, device: torch.device) -> float:
    """The median of `repeat` timed calls after three untimed: CUDA events on a GPU (the host
    clock on a CPU, where this bench runs only as its own smoke test)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        if device.type != "cuda":
            times.append(_sync_time(fn) * 1e6)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _copy_gb_s(device: torch.device, nbytes: int) -> float:
    """Device memory bandwidth, bytes read plus written, from one large copy."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = _event_us(lambda: b.copy_(a), 10, device)
    return 2 * a.numel() / us / 1e3


def _mfa_layer(args, device: torch.device) -> dict:
    """One MFA layer, batch x context already cached (random K/V), one decode row each."""
    from afd.config import ModelConfig
    from afd.kernels import cuda_attention
    from afd.quant import quantize_fp8
    from services.attention import batch as batching
    from services.attention.kv_cache import KVCache
    from services.attention.model import AttentionModel
    from services.attention.paged_attention import paged_attention
    from services.attention.request import Request
    from services.attention.scheduler import ScheduledSeq

    raw = {
        "model_type": "step3_text", **STEP3_ATTENTION, "num_hidden_layers": 1,
        "vocab_size": 1024, "max_position_embedding": args.context + 16,
        "moe_num_experts": 2, "moe_top_k": 1, "moe_intermediate_size": 64,
        "intermediate_size": 64, "share_expert_dim": 64, "moe_layers_enum": "0",
    }  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    H, nh, D, qr = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_dim
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    w = {
        "embed": rand(cfg.vocab_size, H), "lm_head": rand(cfg.vocab_size, H),
        "final_norm": torch.ones(H, dtype=torch.bfloat16, device=device),
        "layers.0.attn_norm": torch.ones(H, dtype=torch.bfloat16, device=device),
        "layers.0.ffn_norm": torch.ones(H, dtype=torch.bfloat16, device=device),
        "layers.0.q_proj": rand(qr, H),
        "layers.0.k_proj": rand(D, H), "layers.0.v_proj": rand(D, H),
        "layers.0.inter_norm": torch.ones(qr, dtype=torch.bfloat16, device=device),
        "layers.0.wq": rand(nh * D, qr), "layers.0.o_proj": rand(H, nh * D),
        "layers.0.router": rand(cfg.num_experts, H),
    }  # fmt: skip
    model = AttentionModel(cfg, torch.bfloat16, w, progress=False, device=device)
    bs, B, L = 16, args.mfa_batch, args.context
    per_seq = -(-(L + 1) // bs)
    caches = {}
    for kv in ("bf16", "fp8"):  # the same random K and V, stored each way
        c = KVCache(model.cache_layout, 1, B * per_seq, bs, torch.bfloat16, device, kv == "fp8")
        for pool, scale, seed in ((c.k[0], c.k_scale[0], 1), (c.v[0], c.v_scale[0], 2)):
            g.manual_seed(seed)
            x = rand(*pool.shape, scale=1.0)
            if scale is None:
                pool.copy_(x)
            else:
                q8, s8 = quantize_fp8(x.view(-1, D))
                pool.view(torch.uint8).copy_(q8.view(torch.uint8).view(pool.shape))
                scale.copy_(s8.view(scale.shape))
        caches[kv] = c
    seqs = [
        ScheduledSeq(Request(f"r{i}", [1] * L), [1], L, list(range(i * per_seq, (i + 1) * per_seq)),
                     sample=True)
        for i in range(B)
    ]  # fmt: skip
    mb = batching.to_device(batching.build(seqs, bs), device)
    h = rand(B, H, scale=1.0)
    lw = model.layers[0]

    q = rand(B, nh, D, scale=1.0)
    layer_us, attn_us = {}, {}
    for kv, c in caches.items():
        for path in ("triton", "torch"):  # the CUDA decode attention's ways (cuda_attention.py)
            os.environ[cuda_attention.ENV] = path

            def layer(c=c):
                model.attention_and_route(0, h, mb.meta, c)

            def attention(c=c):
                paged_attention(q, c.k[0], c.v[0], mb.meta, lw.kind.scale,
                                k_scale=c.k_scale[0], v_scale=c.v_scale[0])  # fmt: skip

            with torch.inference_mode():
                layer_us[f"{kv}/{path}"] = round(_event_us(layer, args.repeat_us, device), 1)
                attn_us[f"{kv}/{path}"] = round(_event_us(attention, args.repeat_us, device), 1)
    os.environ.pop(cuda_attention.ENV)
    best = min(layer_us["bf16/triton"], layer_us["bf16/torch"])
    kv_bytes = 2 * B * L * D * 2  # K and V of the one shared head, bf16
    weight_bytes = 2 * (qr * H + 2 * D * H + nh * D * qr + H * nh * D)
    copy = _copy_gb_s(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    return {
        "shape": {"hidden": H, "q_heads": nh, "head_dim": D, "kv_heads": 1, "q_lora": qr},
        "batch": B,
        "context": L,
        "layer_us": layer_us,
        "attention_us": attn_us,
        "report_us": REPORT_MFA_US,
        "report_over_best_bf16_layer": round(REPORT_MFA_US / best, 2),
        "report_over_fp8_triton_layer": round(REPORT_MFA_US / layer_us["fp8/triton"], 2),
        "bytes_read": kv_bytes + weight_bytes,
        "best_layer_gb_s": round((kv_bytes + weight_bytes) / best / 1e3, 1),
        "copy_gb_s": round(copy, 1),
    }


def run(args: argparse.Namespace) -> dict:
    import transformers

    from afd.device import resolve

    device = resolve(args.device)  # cpu only as the bench's own smoke test
    out: dict = {
        "benchmark": "gpu",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (cpu)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if "decode" in args.parts:
        out["decode"] = _decode(args, device)
    if "mfa" in args.parts:
        out["mfa_layer"] = _mfa_layer(args, device)
        print(json.dumps(out["mfa_layer"]), flush=True)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="afd vs transformers on a CUDA device; the MFA layer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", nargs="+", default=["decode", "mfa"], choices=["decode", "mfa"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="alternating runs per side (median)")
    p.add_argument("--mfa-batch", type=int, default=256)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--repeat-us", type=int, default=20, help="timed repeats per MFA figure")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "afd"))
    p.set_defaults(func=lambda a: print(json.dumps(run(a), indent=2)) or 0)
