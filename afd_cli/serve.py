"""`afd serve`: a whole cluster on this machine, one command (the mechanics: cluster.py).

It takes the engine's and the HTTP API's flag groups as `afd attention` and `afd gateway` do
(declared once, beside those services) and passes what was given on to those children.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from afd import flags
from afd.errors import ConfigError
from afd.flags import build, forward, option
from afd_cli import vllm_flags
from afd_cli.cluster import TRANSPORTS, Cluster, ClusterConfig
from afd_cli.supervisor import Supervisor
from services.attention.flags import add_engine_flags, engine_config
from services.gateway.config import GatewayConfig
from services.gateway.flags import add_api_flags, add_api_key_flag, api_key
from services.gateway.latency import SLA
from services.gateway.routing import RoutingConfig

log = logging.getLogger("afd.serve")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="start a local cluster: FFN + attention + gateway")
    c = ClusterConfig
    flags.add_model_flag(p)
    # as `vllm serve MODEL`: the checkpoint directory may come first, without --model
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="as --model")
    option(p, "--attention", c, "attention", help="N attention servers")
    option(p, "--ffn", c, "ffn", help="M FFN servers (expert shards; with --elastic-ffn, at start)")
    option(
        p,
        "--dtype",
        c,
        "dtype",
        type=flags.compute_dtype,
        help="compute dtype of the attention and FFN servers: bfloat16 or float32 (vLLM's "
        "auto, bf16 and float are taken too)",
    )
    option(
        p,
        "--device",
        c,
        "device",
        help="every server's device: auto, cpu, cuda or cuda:N (auto: the first CUDA device "
        "when one is visible, else cpu)",
    )
    option(p, "--attention-device", c, "attention_device", help="the attention servers' device")
    option(p, "--ffn-device", c, "ffn_device", help="the FFN servers' device")
    option(
        p,
        "--elastic-ffn",
        c,
        "elastic_ffn",
        help="FFN servers that each hold every expert, in a pool that can grow and shrink "
        "while serving (--admin-port; expert placement follows the pool)",
    )
    option(
        p,
        "--admin-port",
        c,
        "admin_port",
        help="serve the admin endpoint (GET/POST /admin/ffn, DELETE /admin/ffn/NAME: list, add "
        "and remove FFN servers) on 127.0.0.1 at this port, with the API key (0: off)",
    )
    option(
        p,
        "--transport",
        c,
        "transport",
        choices=TRANSPORTS,
        help="attention -> FFN data plane (inproc: FFN shards inside each attention process; "
        "auto: separate FFN processes over tcp only where each compute process gets 2 cores)",
    )
    option(
        p,
        "--served-model-name",
        c,
        "served_model_name",
        nargs="+",
        type=str,
        help="the model's name in the API (default: its directory's name); further names are "
        "accepted too, and responses carry the first",
    )
    option(p, "--host", c, "host", help="the gateway's interface")
    option(p, "--port", c, "port", help="the gateway's port (0: any free)")
    option(p, "--threads", c, "threads", help="torch threads per server (0: share the cores)")
    option(p, "--ready-timeout", c, "ready_timeout_s", help="seconds to wait for /ready")
    option(
        p,
        "--max-restarts",
        c,
        "max_restarts",
        help="a child that dies once the cluster is up is restarted, backing off; past this "
        "many restarts within --restart-window it is crash-looping and the cluster stops "
        "(0: stop on any death)",
    )
    option(p, "--restart-window", c, "restart_window_s", help="see --max-restarts, s")
    option(
        p,
        "--drain-timeout",
        c,
        "drain_timeout_s",
        help="on Ctrl-C / SIGTERM: how long the gateway and attention servers let requests in "
        "flight finish (new ones get 503), s",
    )
    add_api_key_flag(p)
    p.set_defaults(engine_actions=add_engine_flags(p), api_actions=add_api_flags(p))
    vllm_flags.add_vllm_flags(p)
    return p


def config(args: argparse.Namespace) -> ClusterConfig:
    if args.model_path is not None:
        if args.model and args.model != args.model_path:
            raise ConfigError(f"two models given: {args.model_path} and --model {args.model}")
        args.model = args.model_path
    vllm_flags.apply(args)
    # What the children would refuse is refused here, before anything starts.
    engine_config(args, ffn_addresses=("inproc://check",))
    build(
        GatewayConfig,
        args,
        model_dir="",
        attention=("check:1",),
        model_name="check",
        sla=build(SLA, args),
        routing=build(RoutingConfig, args),
    )
    return build(
        ClusterConfig,
        args,
        api_key=api_key(args),
        engine_args=tuple(forward(args, args.engine_actions)),
        api_args=tuple(forward(args, args.api_actions)),
    )


def run(args: argparse.Namespace) -> int:
    """`afd serve`: start, announce, restart what dies until a signal or a crash loop, stop."""
    cfg = config(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Cluster(cfg) as cluster:
        cluster.wait_ready(stop)
        for name, url in cluster.metrics_urls.items():
            print(f"metrics of {name}: {url}", flush=True)
        print(f"topology: {cluster.topology}", flush=True)
        print(f"afd is ready: {cluster.url} (model {cluster.model_name})", flush=True)
        admin = _admin(cluster, args)
        supervisor = Supervisor(cluster, cfg.max_restarts, cfg.restart_window_s)
        try:
            while not stop.wait(0.25):
                why = supervisor.check()
                if why is not None:
                    log.error("%s", why)
                    return 1
        finally:
            if admin is not None:
                admin.shutdown()
        log.info("stopping the cluster")
    return 0


def _admin(cluster: Cluster, args: argparse.Namespace):
    """The admin endpoint, where asked for (it adds and removes elastic FFN servers)."""
    cfg = cluster.cfg
    if not cfg.admin_port:
        return None
    from afd_cli.admin import serve_admin
    from afd_cli.elastic import ElasticFFN

    server = serve_admin(ElasticFFN(cluster, args.ffn_pool_interval_s), cfg.admin_port, cfg.api_key)
    print(f"admin: http://127.0.0.1:{cfg.admin_port}/admin/ffn (API key)", flush=True)
    return server
