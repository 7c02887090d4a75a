"""The `afd` command: thin entry points that parse flags into a frozen config and call one
function per job."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.errors import AfdError

log = logging.getLogger("afd")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="local Hugging Face checkpoint directory (default: the "
        "embedded demo model, whose text is meaningless)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="S: micro-batches in flight per step (1 = serial). S >= 2 overlaps attention and "
        "FFN; it pays when the FFN side is compute-bound (large batches); on a small CPU box the "
        "experts are weight-bandwidth-bound and each micro-batch re-reads them (see "
        "`afd bench pipeline`)",
    )
    p.add_argument(
        "--a2f-dtype",
        default="fp8",
        choices=["fp8", "bf16", "fp32"],
        help="hidden states on the wire attention -> FFN",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="backpressure: refuse new requests (429) past this many waiting",
    )
    p.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=1 << 20,
        help="backpressure: ... or past this many waiting prompt tokens",
    )
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's context length")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory for the KV pool")
    p.add_argument("--ffn-timeout", type=float, default=30.0, help="deadline of one FFN call, s")
    p.add_argument(
        "--ffn-failover-timeout",
        type=float,
        default=0.0,
        help="with replicas of a shard: how long one replica may take to answer before the "
        "message goes to another, s (0: the FFN timeout split between the replicas)",
    )


def add_side_port_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-host", default="127.0.0.1", help="interface of the HTTP side port")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="HTTP side port serving /metrics, /health, /ready (0: off)",
    )


def add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data-plane authentication (flags fall back to AFD_* env vars)")
    g.add_argument("--curve-dir", default="", help="ZeroMQ CURVE key directory (afd keys)")
    g.add_argument("--tls-cert", default="", help="gRPC TLS certificate chain (PEM)")
    g.add_argument("--tls-key", default="", help="gRPC TLS private key (PEM)")
    g.add_argument("--tls-ca", default="", help="CA bundle; on a server it demands client certs")


def security(args: argparse.Namespace):
    from afd.security import Security

    return Security(args.curve_dir, args.tls_cert, args.tls_key, args.tls_ca).with_env()


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.model:
        return ModelConfig.from_hf(args.model)
    from afd.demo import demo_model_dir

    return ModelConfig.from_hf(demo_model_dir())


def engine_config(args: argparse.Namespace, ffn: tuple[str, ...] = ()) -> EngineConfig:
    if args.micro_batches < 1:
        raise AfdError("--micro-batches must be >= 1")
    return EngineConfig(
        model=model_config(args),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_gb),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_waiting_requests=args.max_waiting_requests,
            max_waiting_tokens=args.max_waiting_tokens,
        ),
        dtype=args.dtype,
        micro_batches=args.micro_batches,
        a2f_dtype=args.a2f_dtype,
        ffn_timeout_s=args.ffn_timeout,
        ffn_failover_s=args.ffn_failover_timeout,
        threads=args.threads,
        **({"ffn_addresses": ffn} if ffn else {}),
    )


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="offline generation (attention + FFN in one process)")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="one prompt per line, or JSONL with a 'prompt' field")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--ffn-shards", type=int, default=1, help="in-process FFN expert shards")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from afd.control import SamplingParams
    from afd_cli.generate import GenerateJob, read_prompts, run

    prompts = list(args.prompt) + (read_prompts(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        raise AfdError("give at least one --prompt or a --prompts-file")
    job = GenerateJob(
        engine=engine_config(args),
        prompts=tuple(prompts),
        sampling=SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        ),
        num_ffn=args.ffn_shards,
        chat=args.chat,
        as_json=args.json,
    )
    return run(job)


def _ffn_parser(sub) -> None:
    p = sub.add_parser("ffn", help="serve one FFN expert shard (stateless)")
    add_model_args(p)
    p.add_argument("--shard", default="0/1", help="i/N: this server holds shard i of N")
    p.add_argument(
        "--listen",
        default="tcp://127.0.0.1:5600",
        help="data-plane address: tcp://host:port, ipc://path or grpc://host:port",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu"],
        help="compute device (the wire format is device-independent)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=3.0,
        help="on SIGTERM: finish the messages being computed, then answer every message with a "
        "typed 'unavailable' (draining) error for this many seconds (attention servers move its work to "
        "another replica at once instead of waiting out their FFN timeout), then exit 0",
    )
    add_side_port_args(p)
    add_security_args(p)
    p.set_defaults(func=_run_ffn)


def _run_ffn(args: argparse.Namespace) -> int:
    from afd.sharding import ExpertShard
    from services.ffn.server import FFNServiceConfig, inject_delay_from_env, serve

    mc = model_config(args)
    try:
        shard = ExpertShard.parse(args.shard, mc.num_experts)
        delay = inject_delay_from_env()
    except ValueError as e:
        raise AfdError(str(e)) from e
    if args.drain_timeout < 0:
        raise AfdError("--drain-timeout must be >= 0")
    _set_threads(args.threads)
    return serve(
        FFNServiceConfig(
            model=mc,
            shard=shard,
            listen=args.listen,
            dtype=args.dtype,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            security=security(args),
            inject_delay_s=delay,
            drain_s=args.drain_timeout,
        )
    )


def _attention_parser(sub) -> None:
    p = sub.add_parser("attention", help="serve the attention side (KV cache, scheduler, sampler)")
    add_engine_args(p)
    p.add_argument(
        "--ffn",
        required=True,
        help="FFN servers, comma-separated; the i-th holds expert shard i of N; 'A|B' names "
        "replicas of one shard (a failed one's messages go to the other)",
    )
    p.add_argument("--listen", default="127.0.0.1:50051", help="control-plane gRPC host:port")
    p.add_argument("--device", default="cpu", choices=["cpu"])
    add_drain_arg(p)
    add_side_port_args(p)
    add_straggler_args(p)
    add_security_args(p)
    p.set_defaults(func=_run_attention)


def add_drain_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: refuse new requests and let those in flight finish for up to this "
        "many seconds, then exit 0",
    )


def add_straggler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("straggler detection (FFN peers)")
    g.add_argument(
        "--straggler-factor",
        type=float,
        default=2.0,
        help="flag an FFN peer whose round-trip p99 exceeds the rest of the pool's median "
        "by this factor",
    )
    g.add_argument(
        "--straggler-checks", type=int, default=3, help="... at this many consecutive checks"
    )
    g.add_argument("--straggler-window", type=float, default=10.0, help="sliding window, s")
    g.add_argument("--straggler-interval", type=float, default=1.0, help="seconds between checks")


def straggler_config(args: argparse.Namespace):
    from services.attention.stragglers import StragglerConfig

    try:
        return StragglerConfig(
            factor=args.straggler_factor,
            checks=args.straggler_checks,
            window_s=args.straggler_window,
            interval_s=args.straggler_interval,
        )
    except ValueError as e:
        raise AfdError(str(e)) from e


def _run_attention(args: argparse.Namespace) -> int:
    from services.attention.server import AttentionServerConfig, serve

    ffn = tuple(a.strip() for a in args.ffn.split(",") if a.strip())
    if any(not r.strip() for a in ffn for r in a.split("|")):
        raise AfdError(f"--ffn {args.ffn!r}: an empty replica address")
    if args.drain_timeout < 0 or args.ffn_failover_timeout < 0:
        raise AfdError("--drain-timeout and --ffn-failover-timeout must be >= 0")
    cfg = replace(engine_config(args, ffn), security=security(args))
    server_cfg = AttentionServerConfig(
        engine=cfg,
        listen=args.listen,
        model_name=_name(args),
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        stragglers=straggler_config(args),
        drain_timeout_s=args.drain_timeout,
    )
    from afd_cli.local import serve_ffn_inproc, serves_ffn_inproc

    ffn = serve_ffn_inproc(cfg) if serves_ffn_inproc(cfg) else []
    try:
        return serve(server_cfg)
    finally:
        for listener in ffn:
            listener.close()


def _name(args: argparse.Namespace) -> str:
    from pathlib import Path

    return Path(args.model).name if args.model else "afd-demo-step3"


def _set_threads(n: int) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _keys_parser(sub) -> None:
    p = sub.add_parser("keys", help="create a ZeroMQ CURVE key directory for --curve-dir")
    p.add_argument("--out", required=True, help="directory to create")
    p.set_defaults(func=_run_keys)


def _run_keys(args: argparse.Namespace) -> int:
    from afd.security import write_curve_keys

    out = write_curve_keys(args.out)
    print(f"CURVE keys written to {out}: give FFN and attention servers --curve-dir {out}")
    return 0


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    bsub = p.add_subparsers(dest="bench", required=True)
    from afd_cli.bench import engine as bench_engine
    from afd_cli.bench import pipeline as bench_pipeline
    from afd_cli.bench import wire as bench_wire

    bench_engine.add_parser(bsub)
    bench_pipeline.add_parser(bsub)
    from afd_cli.bench import http as bench_http
    from afd_cli.bench import serve as bench_serve

    bench_http.add_parser(bsub)
    bench_serve.add_parser(bsub)
    w = bsub.add_parser(
        "wire", help="FP8 codec, per-layer round trip, bytes on the wire", add_help=False
    )
    w.add_argument("rest", nargs=argparse.REMAINDER)
    w.set_defaults(func=lambda a: bench_wire.main(a.rest) or 0)


def _serving_parsers(sub) -> None:
    from afd_cli import serve
    from services.gateway import app as gateway_app

    gateway_app.add_parser(sub)
    serve.add_parser(sub)


def _plan_parser(sub) -> None:
    try:
        from afd.plan import cli as plan_cli
    except ImportError:  # the planner is optional until it lands
        return
    plan_cli.add_parser(sub).set_defaults(func=plan_cli.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afd", description="Attention-FFN disaggregated MoE inference server"
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _ffn_parser(sub)
    _attention_parser(sub)
    _keys_parser(sub)
    _serving_parsers(sub)
    _bench_parser(sub)
    _plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except AfdError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
