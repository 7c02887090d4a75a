"""Attention and FFN in one process, talking through the in-process transport.

This is the offline `afd generate` path and the test workhorse: the same engine and FFN
server as the distributed deployment, only the transport differs.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import replace

import torch

from afd.config import EngineConfig
from afd.sharding import ExpertShard
from afd.transport import Listener, listen
from services.attention.engine import DTYPES, Engine
from services.ffn.server import FFNServer

_names = itertools.count()


def start_ffn_shards(
    cfg: EngineConfig, n: int, progress: bool = True
) -> tuple[list[Listener], tuple[str, ...]]:
    dtype: torch.dtype = DTYPES[cfg.dtype]
    listeners, addrs = [], []
    tag = next(_names)
    for i in range(n):
        server = FFNServer(
            cfg.model, ExpertShard(i, n, cfg.model.num_experts), dtype, progress=progress
        )
        addr = f"inproc://ffn-{tag}-{i}"
        # With one micro-batch there is nothing to overlap: compute on the engine's thread.
        listeners.append(listen(addr, server.handle, inline=cfg.micro_batches == 1))
        addrs.append(addr)
    return listeners, tuple(addrs)


@contextmanager
def local_engine(cfg: EngineConfig, num_ffn: int = 1, progress: bool = True):
    """An Engine wired to `num_ffn` in-process FFN shards; they are closed on exit."""
    listeners, addrs = start_ffn_shards(cfg, num_ffn, progress)
    try:
        yield Engine(replace(cfg, ffn_addresses=addrs), progress=progress)
    finally:
        for lst in listeners:
            lst.close()
