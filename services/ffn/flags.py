"""`afd ffn`'s flags, each declared against the config field it fills (afd/flags.py)."""

from __future__ import annotations

import argparse

from afd import flags
from afd.flags import build, option
from afd.sharding import ExpertShard
from afd.sidecar import SidePortConfig
from services.ffn.server import FFNServerConfig, inject_delay_from_env

DEFAULT_SHARD = "0/1"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("ffn", help="serve one FFN expert shard (stateless)")
    f = FFNServerConfig
    flags.add_model_flag(p)
    option(p, "--dtype", f, "dtype", choices=["bfloat16", "float32"], help="compute dtype")
    option(p, "--threads", f, "threads", help="torch threads (0: torch's default)")
    option(
        p,
        "--device",
        f,
        "device",
        help="weights and compute: auto, cpu, cuda or cuda:N (auto: the first CUDA device when "
        "one is visible, else cpu)",
    )
    p.add_argument(
        "--shard",
        default=DEFAULT_SHARD,
        help="i/N: this server holds expert shard i of N (default: all experts)",
    )
    option(
        p,
        "--listen",
        f,
        "listen",
        help="data-plane address: tcp://host:port, ipc://path or grpc://host:port",
    )
    option(p, "--max-tokens", f, "max_tokens", help="largest message accepted, in tokens")
    option(
        p,
        "--drain-timeout",
        f,
        "drain_timeout_s",
        help="on SIGTERM: finish the messages being computed, then answer every message with a "
        "typed 'unavailable' (draining) error for this many seconds (attention servers move its "
        "work to another replica at once instead of waiting out their FFN timeout), then exit 0",
    )
    flags.add_expert_flags(p.add_argument_group("MXFP4 experts"))
    flags.add_quantization_flag(p)
    flags.add_side_port_flags(p)
    flags.add_security_flags(p)
    return p


def config(args: argparse.Namespace) -> FFNServerConfig:
    model = flags.model_config(args.model, args.quantization)
    return build(
        FFNServerConfig,
        args,
        model=model,
        shard=ExpertShard.parse(args.shard, model.num_experts),
        side=build(SidePortConfig, args),
        security=flags.security(args),
        inject_delay_s=inject_delay_from_env(),
        experts=flags.experts(args),
    )
