"""The attention server's engine: one loop of schedule -> execute -> update."""

from __future__ import annotations

import itertools
import logging

import torch

from afd.config import EngineConfig
from afd.control import SamplingParams
from afd.dtypes import compute_dtype
from afd.errors import TransportError
from afd.runtime import tune_allocator
from afd.sharding import ExpertShard
from afd.transport import connect
from services.attention.block_manager import BlockManager
from services.attention.dispatch import FFNPool, Peer
from services.attention.kv_cache import KVCache, num_blocks_for
from services.attention.model import AttentionModel
from services.attention.request import Request
from services.attention.runner import ModelRunner
from services.attention.scheduler import Scheduler

log = logging.getLogger("afd.attention")


def ffn_shards(addresses: tuple[str, ...]) -> list[list[str]]:
    """The FFN pool as shards of replicas: the i-th entry serves expert shard i, and an entry
    `a|b` names two replicas of it (either one computes the shard's messages)."""
    return [[a.strip() for a in entry.split("|") if a.strip()] for entry in addresses]


class Engine:
    def __init__(self, cfg: EngineConfig, model: AttentionModel | None = None, progress=True):
        tune_allocator()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        mc = cfg.model
        dtype = compute_dtype(cfg.dtype)
        self.model = model or AttentionModel(mc, dtype, progress=progress)
        num_blocks = num_blocks_for(mc, cfg.cache, dtype)
        self.cache = KVCache(mc, num_blocks, cfg.cache.block_size, dtype)
        self.blocks = BlockManager(num_blocks, cfg.cache.block_size)
        self.max_model_len = min(cfg.scheduler.max_model_len or mc.max_position, mc.max_position)
        self.scheduler = Scheduler(cfg.scheduler, self.blocks, self.max_model_len)
        shards = ffn_shards(cfg.ffn_addresses)
        peers = [
            Peer(connect(addr, security=cfg.security), ExpertShard(i, len(shards), mc.num_experts))
            for i, replicas in enumerate(shards)
            for addr in replicas
        ]
        self.pool = FFNPool(
            mc, peers, cfg.a2f_dtype, dtype, cfg.ffn_timeout_s, failover_s=cfg.ffn_failover_s
        )
        self.runner = ModelRunner(self.model, self.cache, self.pool, cfg.micro_batches)
        self._ids = itertools.count()
        self.last_step_tokens = 0  # tokens computed by the latest step (for the telemetry)

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        req = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling or SamplingParams(),
            eos_token_ids=self.cfg.model.eos_token_ids,
        )
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        self.runner.release(request_id)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One engine step; returns the requests that got a token or finished in it."""
        self.pool.begin_step()
        plan = self.scheduler.schedule()
        self.last_step_tokens = sum(s.num_new_tokens for s in plan.scheduled)
        if not plan.scheduled:
            return []
        try:
            sampled, logprobs = self.runner.execute(plan)
        except TransportError as e:
            return self._fail(plan, e)
        updated = self.scheduler.update(plan, sampled, logprobs)
        for req in updated:
            if req.finished:
                self.runner.release(req.request_id)
        return updated

    def _fail(self, plan, error: TransportError) -> list[Request]:
        """A step the FFN pool could not serve: its requests end with a typed error, the engine
        itself keeps serving the rest."""
        log.error("step failed, failing %d requests: %s", len(plan.scheduled), error)
        failed = []
        for s in plan.scheduled:
            req = s.request
            self.abort(req.request_id)
            req.finish_reason, req.error, req.error_code = "error", str(error), error.code
            failed.append(req)
        return failed

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        """Offline generation: run every prompt to completion, in submission order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.has_unfinished():
            self.step()
        return reqs
