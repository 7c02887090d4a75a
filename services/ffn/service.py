"""The FFN server process: load one expert shard, listen on a data-plane address, serve until
SIGTERM. `afd ffn --model DIR --shard i/N --listen ADDR`"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass

from afd import sidecar
from afd.config import ModelConfig
from afd.sharding import ExpertShard
from afd.transport import listen
from services.attention.engine import DTYPES
from services.ffn.server import FFNServer

log = logging.getLogger("afd.ffn")


@dataclass(frozen=True)
class FFNServiceConfig:
    model: ModelConfig
    shard: ExpertShard
    listen: str = "tcp://127.0.0.1:5600"
    dtype: str = "bfloat16"
    max_tokens: int = 65536  # largest message accepted, in tokens
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # HTTP /metrics, /health, /ready; 0: off


def limits_for(cfg: ModelConfig, max_tokens: int):
    from afd.wire import WireLimits

    return WireLimits(
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_experts=cfg.num_experts,
        max_tokens=max_tokens,
        top_k=cfg.top_k,
    )


def serve(cfg: FFNServiceConfig) -> int:
    server = FFNServer(cfg.model, cfg.shard, DTYPES[cfg.dtype])
    listener = listen(cfg.listen, server.handle, limits=limits_for(cfg.model, cfg.max_tokens))
    log.info(
        "FFN shard %d/%d (experts %d..%d%s) listening on %s",
        cfg.shard.index,
        cfg.shard.count,
        cfg.shard.start,
        cfg.shard.end - 1,
        ", shared expert and dense MLPs" if cfg.shard.owns_dense else "",
        cfg.listen,
    )
    side = sidecar.start(cfg.metrics_host, cfg.metrics_port, lambda: (True, ""))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("FFN server stopping")
    listener.close()
    if side:
        side.close()
    return 0
