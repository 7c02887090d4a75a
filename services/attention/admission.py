"""Whether a new request may join the queue: it can fit the KV pool at all, and the queue is not
over its backpressure bounds (plain Python, no torch)."""

from __future__ import annotations

from collections.abc import Iterable

from afd.config import SchedulerConfig
from afd.errors import OverloadedError, RequestError
from services.attention.block_manager import BlockManager
from services.attention.request import Request


def check_backpressure(cfg: SchedulerConfig, waiting: Iterable[Request], n: int) -> None:
    """Raises OverloadedError when `n` more prompt tokens would put the queue past its bounds."""
    waiting = list(waiting)
    if len(waiting) >= cfg.max_waiting_requests:
        raise OverloadedError(
            f"{len(waiting)} requests are already waiting (limit "
            f"{cfg.max_waiting_requests}); retry later"
        )
    waiting_tokens = sum(r.num_tokens for r in waiting)
    if waiting_tokens + n > cfg.max_waiting_tokens:
        raise OverloadedError(
            f"{waiting_tokens} prompt tokens are already waiting (limit "
            f"{cfg.max_waiting_tokens}); retry later"
        )


def check_fits_pool(bm: BlockManager, req: Request, max_model_len: int) -> None:
    # The most K/V a request ever holds is one token short of its longest possible sequence
    # (the last sampled token is never computed; drafts stay within it: speculative.room). If
    # even an empty pool cannot hold that, preemption could never make room and the request
    # would wait forever.
    longest = min(req.num_prompt_tokens + req.sampling.max_tokens, max_model_len)
    need = bm.blocks_needed(longest - 1)
    if need > bm.num_blocks:
        raise RequestError(
            f"request may need {longest - 1} tokens of KV cache ({need} blocks) but the KV "
            f"pool holds {bm.num_blocks} blocks ({bm.num_blocks * bm.block_size} tokens); "
            "lower max_tokens or the context length, or give the KV cache more memory"
        )
