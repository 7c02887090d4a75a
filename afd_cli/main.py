"""The `afd` command: each subcommand's flags are declared beside what they configure (the
services' flags.py, generate.py, serve.py); here they are assembled, parsed into a frozen
config, and handed to the one function that runs the job."""

from __future__ import annotations

import argparse
import logging
import sys

from afd.errors import AfdError

log = logging.getLogger("afd")


def _run_generate(args: argparse.Namespace) -> int:
    from afd_cli.generate import job, run

    return run(job(args))


def _run_ffn(args: argparse.Namespace) -> int:
    from services.ffn.flags import config
    from services.ffn.server import serve

    return serve(config(args))


def _run_attention(args: argparse.Namespace) -> int:
    from afd.runtime import on_own_thread
    from afd_cli.local import serve_ffn_inproc, serves_ffn_inproc
    from services.attention.flags import config
    from services.attention.server import serve

    cfg = config(args)
    # `afd serve --transport inproc`: this process serves the expert shards itself
    inproc = serves_ffn_inproc(cfg.engine)
    ffn = on_own_thread(serve_ffn_inproc, cfg.engine) if inproc else []
    try:
        return serve(cfg)
    finally:
        for listener in ffn:
            listener.close()


def _run_gateway(args: argparse.Namespace) -> int:
    from services.gateway.app import serve
    from services.gateway.flags import config

    return serve(config(args))


def _run_keys(args: argparse.Namespace) -> int:
    from afd.security import write_curve_keys

    out = write_curve_keys(args.out)
    print(f"CURVE keys written to {out}: give FFN and attention servers --curve-dir {out}")
    return 0


def bench_parser() -> argparse.ArgumentParser:
    """`afd bench`'s own parser. Its subcommands import torch and the services, so it is built
    only when a benchmark runs: every other command (the gateway above all, which loads no
    torch) starts without them."""
    from afd_cli.bench import (
        context,
        engine,
        gpu,
        http,
        mxfp4,
        peer,
        pipeline,
        prefix,
        quality,
        serve,
        spec,
        weights,
        wire,
    )  # fmt: skip

    parser = argparse.ArgumentParser(prog="afd bench", description="benchmarks that print JSON")
    bsub = parser.add_subparsers(dest="bench", required=True)
    benches = (engine, gpu, pipeline, http, serve, peer, context, weights, mxfp4, quality, prefix)
    benches += (spec,)
    for bench in benches:
        bench.add_parser(bsub)
    w = bsub.add_parser(
        "wire", help="FP8 codec, per-layer round trip, bytes on the wire", add_help=False
    )
    w.add_argument("rest", nargs=argparse.REMAINDER)
    w.set_defaults(func=lambda a: wire.main(a.rest) or 0)
    return parser


def _run_bench(args: argparse.Namespace) -> int:
    if args.rest[:1] == ["wire"]:  # its own parser takes the rest, options first included
        from afd_cli.bench import wire

        return int(wire.main(args.rest[1:]) or 0)
    inner = bench_parser().parse_args(args.rest)
    return int(inner.func(inner) or 0)


def _bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks that print JSON (afd bench --help lists them)",
        add_help=False,
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run_bench)


def _add_generate(sub) -> None:
    from afd_cli import generate

    generate.add_parser(sub).set_defaults(func=_run_generate)


def _add_ffn(sub) -> None:
    from services.ffn import flags as ffn_flags

    ffn_flags.add_parser(sub).set_defaults(func=_run_ffn)


def _add_attention(sub) -> None:
    from services.attention import flags as attention_flags

    attention_flags.add_parser(sub).set_defaults(func=_run_attention)


def _add_keys(sub) -> None:
    keys = sub.add_parser("keys", help="create a ZeroMQ CURVE key directory for --curve-dir")
    keys.add_argument("--out", required=True, help="directory to create")
    keys.set_defaults(func=_run_keys)


def _add_gateway(sub) -> None:
    from services.gateway import flags as gateway_flags

    gateway_flags.add_parser(sub).set_defaults(func=_run_gateway)


def _add_serve(sub) -> None:
    from afd_cli import serve

    serve.add_parser(sub).set_defaults(func=serve.run)


def _add_quantize(sub) -> None:
    from afd_cli import quantize

    quantize.add_parser(sub)


def _add_plan(sub) -> None:
    from afd.plan import cli as plan_cli

    plan_cli.add_parser(sub).set_defaults(func=plan_cli.run)


def _add_chat(sub) -> None:
    from afd_cli import client

    client.add_parser(sub, "chat")


def _add_complete(sub) -> None:
    from afd_cli import client

    client.add_parser(sub, "complete")


# Subcommand -> what adds its parser. Each imports its own flags, and some of those import the
# services (torch among them); a process that runs one command builds only that command's
# parser, so `afd gateway` (which `afd serve` restarts when it dies) starts without torch.
COMMANDS = {
    "generate": _add_generate,
    "ffn": _add_ffn,
    "attention": _add_attention,
    "keys": _add_keys,
    "gateway": _add_gateway,
    "serve": _add_serve,
    "quantize": _add_quantize,
    "bench": _bench_parser,
    "plan": _add_plan,
    "chat": _add_chat,
    "complete": _add_complete,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or, given a command, the parser with that command only."""
    parser = argparse.ArgumentParser(
        prog="afd", description="Attention-FFN disaggregated MoE inference server"
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add in COMMANDS.items():
        if command is None or name == command:
            add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the command is the first word that names one (--log-level's value never does)
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":  # everything after it is the bench parser's, --help included
        args.rest = argv[argv.index("bench") + 1 :]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
