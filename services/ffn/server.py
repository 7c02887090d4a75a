"""The FFN server process: load one expert shard, listen on a data-plane address, serve until
SIGTERM. `afd ffn --model DIR --shard i/N --listen ADDR`

SIGTERM drains: the messages being computed are answered as usual, then every message gets a
typed `unavailable` ("draining") reply for `drain_timeout_s` seconds, so each attention server
moves the shard's work to another replica at its first message (or fails those requests with a clear
error) instead of waiting out its FFN timeout on a server that is gone; /ready says draining.
Then the server exits 0. A second signal cuts the drain short.

Fault injection (tests, drills): AFD_FFN_INJECT_DELAY_MS=N in this process's environment adds
N ms to every layer call's compute, which makes the server a straggler the attention side
must detect. Never set it in production.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass, field

import torch

from afd import metrics, sidecar
from afd.config import COMPUTE_DTYPES, ExpertConfig, ModelConfig, check, check_device
from afd.device import resolve as resolve_device
from afd.dtypes import compute_dtype
from afd.errors import ConfigError
from afd.runtime import freeze_startup_heap, on_own_thread
from afd.security import Security
from afd.sharding import ExpertShard
from afd.sidecar import SidePortConfig
from afd.transport import listen
from afd.transport.serving import FFNServing
from afd.wire import WireLimits
from services.ffn.engine import FFNEngine

log = logging.getLogger("afd.ffn")


@dataclass(frozen=True)
class FFNServerConfig:
    model: ModelConfig
    shard: ExpertShard
    listen: str = "tcp://127.0.0.1:5600"  # data-plane address: tcp://, ipc:// or grpc://
    dtype: str = "bfloat16"  # compute dtype
    device: str = "auto"  # weights and compute: auto | cpu | cuda | cuda:N (afd/device.py)
    threads: int = 0  # torch threads; 0: torch's default
    max_tokens: int = 65536  # largest message accepted, in tokens
    side: SidePortConfig = field(default_factory=SidePortConfig)
    security: Security = field(default_factory=Security)
    inject_delay_s: float = 0.0  # fault injection; see the module docstring
    experts: ExpertConfig = field(default_factory=ExpertConfig)  # MXFP4 experts' compute
    # After SIGTERM: finish the messages being computed, then answer every message with a
    # typed 'unavailable' (draining) error this long, then exit.
    drain_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        check("://" in self.listen, f"--listen must be scheme://address, got {self.listen!r}")
        check(self.dtype in COMPUTE_DTYPES, f"dtype must be one of {COMPUTE_DTYPES}")
        check_device(self.device)
        check(self.threads >= 0, f"threads must be >= 0, got {self.threads}")
        check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        check(self.inject_delay_s >= 0, "the injected delay must be >= 0")
        check(
            self.drain_timeout_s >= 0, f"the drain timeout must be >= 0, got {self.drain_timeout_s}"
        )


INJECT_DELAY_ENV = "AFD_FFN_INJECT_DELAY_MS"


def inject_delay_from_env() -> float:
    """Seconds of injected compute delay from AFD_FFN_INJECT_DELAY_MS (unset or empty: 0)."""
    raw = os.environ.get(INJECT_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        raise ConfigError(
            f"{INJECT_DELAY_ENV} must be a number of milliseconds, got {raw!r}"
        ) from None
    check(ms >= 0, f"{INJECT_DELAY_ENV} must be >= 0, got {raw!r}")
    return ms / 1e3


def serve(cfg: FFNServerConfig) -> int:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    metrics.register("ffn")
    engine = on_own_thread(  # the serving thread's OpenMP pool the only one
        FFNEngine,
        cfg.model,
        cfg.shard,
        compute_dtype(cfg.dtype),
        inject_delay_s=cfg.inject_delay_s,
        experts=cfg.experts,
        device=resolve_device(cfg.device),
    )
    serving = FFNServing(engine.compute, WireLimits.for_model(cfg.model, cfg.max_tokens))
    if cfg.inject_delay_s:
        log.warning(
            "fault injection: %s adds %.1f ms to every layer call",
            INJECT_DELAY_ENV,
            cfg.inject_delay_s * 1e3,
        )
    freeze_startup_heap()
    listener = listen(cfg.listen, serving, security=cfg.security)
    log.info(
        "FFN shard %d/%d (experts %d..%d%s) listening on %s",
        cfg.shard.index,
        cfg.shard.count,
        cfg.shard.start,
        cfg.shard.end - 1,
        ", shared expert and dense MLPs" if cfg.shard.owns_dense else "",
        cfg.listen,
    )
    side = sidecar.start(
        cfg.side,
        lambda: (False, "draining") if serving.draining else (True, ""),
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serving.draining = True
    if cfg.drain_timeout_s > 0:
        log.info("FFN server draining for %.1f s", cfg.drain_timeout_s)
        stop.clear()
        stop.wait(cfg.drain_timeout_s)  # a second signal ends it early
    log.info("FFN server stopping")
    listener.close()
    if side:
        side.close()
    return 0
