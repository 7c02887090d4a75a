"""Attention and FFN in one process, talking through the in-process transport.

This is the offline `afd generate` path and the test workhorse: the same engine and FFN
compute as the distributed deployment, the same serving loop, only the transport differs.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import replace

from afd import metrics
from afd.config import EngineConfig
from afd.device import resolve as resolve_device
from afd.dtypes import compute_dtype
from afd.sharding import ExpertShard, pool_shards
from afd.transport import FFNServing, Listener, listen
from afd.wire import WireLimits
from services.attention.engine import Engine
from services.ffn.engine import FFNEngine

_names = itertools.count()
MAX_TOKENS = 65536  # largest message an in-process FFN shard accepts, in tokens


def serves_ffn_inproc(cfg: EngineConfig) -> bool:
    """Every FFN address is inproc://: the attention process serves the expert shards itself
    (`afd serve --transport inproc`)."""
    return bool(cfg.ffn_addresses) and all(a.startswith("inproc://") for a in cfg.ffn_addresses)


def serve_ffn_inproc(cfg: EngineConfig, progress: bool = True) -> list[Listener]:
    """Serve the expert shards at cfg.ffn_addresses (every one inproc://) in this process:
    shard i of N at the i-th address, one FFN engine per replica."""
    shards, model = pool_shards(cfg.ffn_addresses), cfg.model
    limits = WireLimits.for_model(model, MAX_TOKENS)
    metrics.register("ffn")
    device = resolve_device(cfg.ffn_device or cfg.device)
    listeners = []
    for i, replicas in enumerate(shards):
        for addr in replicas:
            shard = ExpertShard(i, len(shards), model.num_experts)
            engine = FFNEngine(
                model, shard, compute_dtype(cfg.dtype), progress=progress,
                experts=cfg.experts, device=device,
            )  # fmt: skip
            # With one micro-batch there is nothing to overlap: compute on the engine's thread.
            serving = FFNServing(engine.compute, limits, device, engine.inline_experts)
            listeners.append(listen(addr, serving, inline=cfg.micro_batches == 1))
    return listeners


@contextmanager
def local_engine(cfg: EngineConfig, num_ffn: int = 1, progress: bool = True):
    """An Engine wired to `num_ffn` in-process FFN shards; they are closed on exit."""
    tag = next(_names)
    cfg = replace(cfg, ffn_addresses=tuple(f"inproc://ffn-{tag}-{i}" for i in range(num_ffn)))
    listeners = serve_ffn_inproc(cfg, progress)
    try:
        yield Engine(cfg, progress=progress)
    finally:
        for lst in listeners:
            lst.close()
