"""`afd attention`'s flags, and the engine's flag group (also taken by `afd generate` and
`afd serve`, which passes it on to its attention servers). Each flag is declared against the
config field it fills (afd/flags.py), so its default is that field's default."""

from __future__ import annotations

import argparse

from afd import flags
from afd.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from afd.errors import ConfigError
from afd.flags import build, option
from afd.sidecar import SidePortConfig
from services.attention.server import AttentionServerConfig
from services.attention.stragglers import StragglerConfig


def add_compute_flags(p: argparse.ArgumentParser) -> None:
    e = EngineConfig
    option(
        p,
        "--dtype",
        e,
        "dtype",
        type=flags.compute_dtype,
        help="compute dtype: bfloat16 or float32 (vLLM's auto, bf16 and float are taken too)",
    )
    option(p, "--threads", e, "threads", help="torch threads (0: torch's default)")
    option(
        p,
        "--device",
        e,
        "device",
        help="weights, KV cache and compute: auto, cpu, cuda or cuda:N (auto: the first CUDA "
        "device when one is visible, else cpu)",
    )
    option(
        p,
        "--ffn-device",
        e,
        "ffn_device",
        help="the in-process FFN shards' device (afd generate, --transport inproc); default: "
        "--device",
    )


def add_engine_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The engine's own settings (not the model, the compute, the FFN pool or security);
    returns the actions so that a launcher can pass the values on (afd.flags.forward)."""
    g = p.add_argument_group("engine")
    e, c, s = EngineConfig, CacheConfig, SchedulerConfig
    return [
        option(
            g,
            "--micro-batches",
            e,
            "micro_batches",
            help="S: micro-batches in flight per step (1 = serial). S >= 2 overlaps attention "
            "and FFN; it pays when the FFN side is compute-bound (large batches); on a small CPU "
            "box the experts are weight-bandwidth-bound and each micro-batch re-reads them "
            "(see `afd bench pipeline`)",
        ),
        option(
            g,
            "--no-decode-stack",
            e,
            "decode_stack",
            help="run a decode step's layers one by one even where attention and the one expert "
            "shard share this process (there they are one native call by default; same tokens)",
        ),
        option(
            g,
            "--num-scheduler-steps",
            e,
            "num_scheduler_steps",
            help="decode steps per scheduling, at most (vLLM's multi-step): where attention and "
            "the one expert shard share this process and every running request is greedy or "
            "sampled without a seed, the native stack runs up to this many steps in one call, "
            "each from the tokens the last one chose, while no request waits and a burst stays "
            "within ~25 ms (1: one step a call)",
        ),
        option(
            g,
            "--a2f-dtype",
            e,
            "a2f_dtype",
            choices=["fp8", "bf16", "fp32"],
            help="hidden states on the wire attention -> FFN",
        ),
        option(g, "--max-num-seqs", s, "max_num_seqs", help="requests in one step, at most"),
        option(g, "--max-num-batched-tokens", s, "max_num_batched_tokens"),
        option(
            g,
            "--max-waiting-requests",
            s,
            "max_waiting_requests",
            help="backpressure: refuse new requests (429) past this many waiting",
        ),
        option(
            g,
            "--max-waiting-tokens",
            s,
            "max_waiting_tokens",
            help="backpressure: ... or past this many waiting prompt tokens",
        ),
        option(
            g,
            "--scheduling-policy",
            s,
            "scheduling_policy",
            choices=["fcfs", "priority"],
            help="fcfs: requests in arrival order; priority: by each request's `priority` "
            "(lower first, then arrival), which also picks whom a full KV cache preempts",
        ),
        option(g, "--max-model-len", s, "max_model_len", help="0: the model's context length"),
        option(
            g,
            "--no-chunked-prefill",
            s,
            "enable_chunked_prefill",
            help="compute a prompt in one step, never in chunks within the step's token budget "
            "(then --max-num-batched-tokens must hold the longest context)",
        ),
        option(
            g,
            "--sampling-seed",
            e,
            "sampling_seed",
            help="seed of the sampler's generator for requests without a seed of their own "
            "(-1: not seeded; vLLM's --seed on afd serve)",
        ),
        option(g, "--block-size", c, "block_size", help="tokens per KV block"),
        option(g, "--kv-cache-gb", c, "kv_cache_memory_gb", help="memory for the KV pool (CPU)"),
        option(
            g,
            "--kv-cache-dtype",
            c,
            "kv_cache_dtype",
            choices=["auto", "fp8"],
            help="K and V in the cache: auto (the compute dtype) or fp8 (e4m3, a float32 scale "
            "per token and head: about half the bytes; afd's native CPU attention kernels read "
            "bf16 only, so on a CPU attention takes the torch path)",
        ),
        option(
            g,
            "--gpu-memory-utilization",
            c,
            "gpu_memory_utilization",
            help="on a CUDA device: the share of its memory this server may use; the KV cache "
            "takes what the weights and a step's activations leave of it",
        ),
        option(
            g,
            "--no-prefix-caching",
            c,
            "enable_prefix_caching",
            help="compute every prompt in full, even where an earlier request computed the K/V "
            "of the same prefix (default: reuse it)",
        ),
        option(g, "--ffn-timeout", e, "ffn_timeout_s", help="deadline of one FFN call, s"),
        option(
            g,
            "--ffn-failover-timeout",
            e,
            "ffn_failover_s",
            help="with replicas of a shard: how long one replica may take to answer before the "
            "message goes to another, s (0: the FFN timeout split between the replicas)",
        ),
        option(
            g,
            "--ffn-grace",
            e,
            "ffn_grace_s",
            help="when an expert shard loses its last FFN server: how long its requests wait, "
            "paused with their KV cache, for it to come back before they fail, s (0: fail at once)",
        ),
        option(
            g,
            "--ffn-pool-interval",
            e,
            "ffn_pool_interval_s",
            help="elastic FFN pool: how often its source is read again, s",
        ),
        option(
            g,
            "--hot-expert-replicas",
            e,
            "hot_expert_replicas",
            help="elastic FFN pool: per layer, this many of the most loaded experts are computed "
            "by two members, their tokens split between them",
        ),
        option(
            g,
            "--speculative-config",
            e,
            "speculative",
            type=flags.json_object,
            help='speculative decoding, as vLLM takes it: \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
            "(optional keys: disable_by_batch_size, off above that many requests). A request "
            "guesses its next tokens from its own earlier text and one step checks them; greedy "
            "tokens are those it would have had without guesses, sampled ones are distributed "
            "as they would have been. Requests with bad words, allowed_token_ids or an unmet "
            "min_tokens decode a token a step",
        ),
        *flags.add_expert_flags(g),
        flags.add_quantization_flag(g),
        flags.add_lm_head_flag(g),
    ]


def engine_config(args: argparse.Namespace, **given) -> EngineConfig:
    return build(
        EngineConfig,
        args,
        model=flags.model_config(args.model, args.quantization, args.quantize_lm_head),
        cache=build(CacheConfig, args),
        scheduler=build(SchedulerConfig, args),
        experts=flags.experts(args),
        speculative=SpeculativeConfig.from_dict(args.speculative) if args.speculative else None,
        **given,
    )


def add_straggler_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("straggler detection (FFN peers)")
    s = StragglerConfig
    option(
        g,
        "--straggler-factor",
        s,
        "factor",
        help="flag an FFN peer whose round-trip p99 exceeds the rest of the pool's median "
        "by this factor",
    )
    option(g, "--straggler-checks", s, "checks", help="... at this many consecutive checks")
    option(g, "--straggler-window", s, "window_s", help="sliding window, s")
    option(g, "--straggler-interval", s, "interval_s", help="seconds between checks")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("attention", help="serve the attention side (KV cache, scheduler, sampler)")
    flags.add_model_flag(p)
    add_compute_flags(p)
    add_engine_flags(p)
    p.add_argument(
        "--ffn",
        default="",
        help="FFN servers, comma-separated; the i-th holds expert shard i of N; 'A|B' names "
        "replicas of one shard (a failed one's messages go to the other)",
    )
    option(
        p,
        "--ffn-pool",
        EngineConfig,
        "ffn_pool",
        help="instead of --ffn, an elastic pool of FFN servers that each hold every expert, "
        "read again while serving: file:PATH (one address per line) or dns:SCHEME://NAME:PORT "
        "(every address NAME resolves to: a Kubernetes headless Service)",
    )
    a = AttentionServerConfig
    option(p, "--listen", a, "listen", help="control-plane gRPC host:port")
    option(
        p,
        "--drain-timeout",
        a,
        "drain_timeout_s",
        help="on SIGTERM: refuse new requests and let those in flight finish for up to this "
        "many seconds, then exit 0",
    )
    flags.add_side_port_flags(p)
    add_straggler_flags(p)
    flags.add_security_flags(p)
    return p


def config(args: argparse.Namespace) -> AttentionServerConfig:
    ffn = tuple(a.strip() for a in args.ffn.split(",") if a.strip())
    if bool(ffn) == bool(args.ffn_pool):
        raise ConfigError("give the FFN servers with either --ffn or --ffn-pool (one of them)")
    given = {"ffn_addresses": ffn} if ffn else {}
    engine = engine_config(args, security=flags.security(args), **given)
    return build(
        AttentionServerConfig,
        args,
        engine=engine,
        model_name=flags.served_name(args.model),
        side=build(SidePortConfig, args),
        stragglers=build(StragglerConfig, args),
    )
