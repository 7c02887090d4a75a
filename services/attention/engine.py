"""The attention server's engine: one loop of schedule -> execute -> update.

`step()` returns what happened in it (the requests that got a token or finished, and the
step's stats); `load()` says how busy the engine is; the FFN pool's readiness and upkeep go
through `check_ffn` and `maintain_ffn`. Nothing outside reaches into the scheduler, the block
manager or the dispatcher.

An FFN outage pauses the engine rather than failing its requests. Every MoE layer sends each
token to every expert shard, so no step can finish while a shard has no live replica. Until one
is back (and for at most `ffn_grace_s`) steps are held: requests keep their KV blocks and their
place, new ones queue. A step that was in flight when the last replica went is run again from
its start: the scheduler advances a request only in `update()`, after a step that completed,
and re-running the step rewrites the same K/V into the same slots. After the grace period the
requests fail with the typed error, as they would with no grace.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from afd import hugepages
from afd.config import EngineConfig
from afd.control import SamplingParams, Stats
from afd.device import memory as device_memory
from afd.device import resolve as resolve_device
from afd.dtypes import compute_dtype
from afd.errors import AfdError, ConfigError, DeviceMemoryError, RequestError, TransportError
from afd.runtime import tune_allocator
from afd.sharding import ExpertShard, pool_shards
from afd.transport import connect
from services.attention import burst
from services.attention.block_manager import BlockManager
from services.attention.dispatch import FFNDispatcher
from services.attention.elastic import ElasticPool
from services.attention.kv_cache import (
    CacheLayout,
    DevicePlan,
    KVCache,
    activation_bytes,
    num_blocks_for,
)
from services.attention.model import AttentionModel
from services.attention.pool_source import PoolSource
from services.attention.replicas import Peer, Replicas
from services.attention.request import Request
from services.attention.runner import ModelRunner
from services.attention.scheduler import Scheduler
from services.attention.speculative import NgramDrafter
from services.attention.step_record import StepTiming

log = logging.getLogger("afd.attention")
# a request whose constraints leave no token to choose (a grammar and allowed_token_ids that
# share none, say) ends with this; the step's other requests go on
NO_TOKEN = RequestError(
    "no token can be chosen: the request's structured output, allowed_token_ids, bad_words "
    "and min_tokens together exclude every token of the vocabulary"
)


@dataclass(frozen=True)
class StepResult:
    """What one step did: the requests that got a token or finished (failed ones included),
    the tokens it computed, and where its FFN time went."""

    requests: list[Request] = field(default_factory=list)
    tokens: int = 0
    timing: StepTiming = field(default_factory=StepTiming)
    paused: bool = False  # held for an expert shard with no live replica (nothing was computed)
    # speculative decoding: requests that drafted, their drafts, and the drafts kept; and of
    # those, how many were kept at each position (0: a request's first draft)
    drafts: tuple[int, int, int] = (0, 0, 0)
    kept_at: tuple[int, ...] = ()


class Engine:
    def __init__(self, cfg: EngineConfig, model: AttentionModel | None = None, progress=True):
        tune_allocator()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.sampling_seed >= 0:  # requests without a seed draw from the global generator
            torch.manual_seed(cfg.sampling_seed)
        self.cfg = cfg
        mc = cfg.model
        dtype = compute_dtype(cfg.dtype)
        self.device = device = resolve_device(cfg.device)
        self.model = model or AttentionModel(mc, dtype, progress=progress, device=device)
        self.max_model_len = min(cfg.scheduler.max_model_len or mc.max_position, mc.max_position)
        layout = self.model.cache_layout
        num_blocks = self._num_blocks(layout, dtype)
        fp8 = cfg.cache.kv_cache_dtype == "fp8"
        self.cache = KVCache(
            layout, mc.num_layers, num_blocks, cfg.cache.block_size, dtype, device, fp8
        )
        self.blocks = BlockManager(num_blocks, cfg.cache.block_size)
        self.scheduler = Scheduler(
            cfg.scheduler,
            self.blocks,
            self.max_model_len,
            cfg.cache.enable_prefix_caching,
            NgramDrafter(cfg.speculative) if cfg.speculative else None,
        )
        shards = [] if cfg.ffn_pool else pool_shards(cfg.ffn_addresses)
        peers = [
            Peer(connect(addr, security=cfg.security), ExpertShard(i, len(shards), mc.num_experts))
            for i, replicas in enumerate(shards)
            for addr in replicas
        ]
        self.replicas = Replicas(mc, peers, cfg.ffn_timeout_s, cfg.ffn_failover_s)
        self.dispatcher = FFNDispatcher(mc, self.replicas, cfg.a2f_dtype, dtype, device=device)
        self.pool: ElasticPool | None = None
        if cfg.ffn_pool:
            self.pool = ElasticPool(
                mc,
                PoolSource(cfg.ffn_pool, cfg.ffn_pool_interval_s),
                self.replicas,
                lambda addr: connect(addr, security=cfg.security),
                self.dispatcher.expert_load,
                cfg.hot_expert_replicas,
            )
            self.dispatcher.placement = self.pool.placement
        self.runner = ModelRunner(
            self.model, self.cache, self.dispatcher, cfg.micro_batches, cfg.decode_stack
        )
        self._ids = itertools.count()
        self._outage_since: float | None = None  # monotonic: a shard lost its last replica
        # decode steps in one native call where the stack runs (burst.py)
        self._bursts = burst.Policy(cfg.num_scheduler_steps if cfg.decode_stack else 1)
        if device.type == "cpu":  # the weights and KV cache read every step: in 2 MiB pages
            hugepages.back_loaded()

    def _num_blocks(self, layout: CacheLayout, dtype: torch.dtype) -> int:
        """The KV pool's size: on the host as the cache config says; on a CUDA device (without
        --num-blocks) what --gpu-memory-utilization leaves after the weights and a step's
        activations, reported here; no room for one block is a start-up error."""
        cc, mc = self.cfg.cache, self.cfg.model
        if self.device.type == "cpu" or cc.num_blocks:
            return num_blocks_for(layout, mc, cc, dtype)
        mem = device_memory(self.device)
        s = self.cfg.scheduler
        plan = DevicePlan(
            total=mem.total,
            utilization=cc.gpu_memory_utilization,
            ours=mem.ours,
            free=mem.free,
            activations=activation_bytes(
                mc, s.max_num_batched_tokens, s.max_num_seqs, self.max_model_len
            ),
            block_bytes=cc.block_size
            * layout.bytes_per_token(mc.num_layers, dtype, cc.kv_cache_dtype == "fp8"),
        )
        if plan.num_blocks < 1:
            raise ConfigError(
                f"no room for a KV cache on {self.device}: {plan.describe()} leaves "
                f"{plan.kv_bytes / (1 << 30):.2f} GiB; raise --gpu-memory-utilization or lower "
                "--max-num-batched-tokens / --max-model-len"
            )
        log.info(
            "KV cache on %s: %d blocks of %d tokens (%.2f GiB) = %s",
            self.device, plan.num_blocks, cc.block_size,
            plan.num_blocks * plan.block_bytes / (1 << 30), plan.describe(),
        )  # fmt: skip
        return plan.num_blocks

    @property
    def expert_load(self) -> torch.Tensor:
        """[L, E] tokens routed to each expert since start (read, never written, outside)."""
        return self.dispatcher.expert_load

    @property
    def ffn_addresses(self) -> list[str]:
        """Every FFN replica this engine sends to."""
        return [p.address for p in self.replicas.peers]

    def load(self) -> Stats:
        """How busy the engine is (the control plane's Stats; draining is the server's)."""
        s = self.scheduler
        return Stats(
            s.num_running,
            s.num_waiting,
            self.blocks.usage,
            s.num_preemptions,
            prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits,
        )

    def check_ffn(self, timeout: float) -> None:
        """Readiness: raises TransportError unless every expert shard has a live replica."""
        self.replicas.ping(timeout)

    @property
    def ffn_all_up(self) -> bool:
        return self.replicas.all_up

    def maintain_ffn(self) -> None:
        """Between steps: probe FFN replicas marked down, and take in an elastic pool's
        changes (never blocks)."""
        self.replicas.maintain()
        self._refresh_pool()

    def _refresh_pool(self) -> None:
        if self.pool is not None:
            self.pool.refresh()
            self.dispatcher.placement = self.pool.placement

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queue a request; raises RequestError for one that cannot be served (a token id
        outside the vocabulary, no room in the context, a full queue)."""
        sampling = sampling or SamplingParams()
        vocab = self.cfg.model.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is out of range (vocabulary: {vocab})")
        named = {  # every token id the sampler indexes its logits with
            "logit_bias": [t for t, _ in sampling.logit_bias],
            "stop_token_ids": sampling.stop_token_ids,
            "bad_words": [t for w in sampling.bad_words for t in w],
            "allowed_token_ids": sampling.allowed_token_ids,
        }
        for name, k in (
            ("logprobs", sampling.logprobs),
            ("prompt_logprobs", sampling.prompt_logprobs),
        ):
            if k is not None and k > vocab:
                raise RequestError(f"{k} {name} asked for; the vocabulary has {vocab} tokens")
        for name, ids in named.items():
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise RequestError(f"{name} token id {bad} is out of range (vocabulary: {vocab})")
        req = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            eos_token_ids=self.cfg.model.eos_token_ids,
        )
        self.runner.guides.start(req)  # a guide that does not compile is this request's error
        try:
            self.scheduler.add_request(req)
        except Exception:
            self.runner.guides.release(req.request_id)
            raise
        return req

    def abort(self, request_id: str) -> bool:
        self.runner.release(request_id)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        """One engine step: schedule -> execute -> update (or a pause, see the module's doc)."""
        self.dispatcher.begin_step()
        self._refresh_pool()
        if self._hold():
            return StepResult(paused=True)
        t0 = time.perf_counter()
        # a burst only where the stack can run it: the one shard is called in process
        steps = self._bursts.steps() if self.dispatcher.inline_shard() is not None else 1
        plan = burst.extend(
            self.scheduler, self.scheduler.schedule(), steps, self.cfg.sampling_seed < 0
        )
        tokens = sum(s.num_new_tokens for s in plan.scheduled)
        if not plan.scheduled:
            return StepResult()
        try:
            done = self.runner.execute(plan)
        except TransportError as e:
            if self._hold():  # the step is planned again once the shard is back
                return StepResult(paused=True)
            return StepResult(self._fail(plan, e), tokens, self.dispatcher.timing)
        except torch.OutOfMemoryError:
            # the step's temporaries did not fit beside the weights and KV pool: its requests
            # fail with the cause, the pool and every other request are untouched
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            why = DeviceMemoryError(
                f"out of memory on {self.device} in a step of {tokens} tokens: lower "
                "--max-num-batched-tokens or --gpu-memory-utilization"
            )
            return StepResult(self._fail(plan, why), tokens, self.dispatcher.timing)
        failed = self._fail_requests(
            [s.request for s in plan.scheduled if s.request.request_id in done.stuck], NO_TOKEN
        )
        updated = self.scheduler.update(
            plan, done.sampled, done.logprobs, done.prompt_logprobs, done.ended, done.kept
        )
        updated += failed
        if tokens == len(plan.scheduled):  # decodes alone: the steps a burst's length is for
            self._bursts.observe(time.perf_counter() - t0, done.steps)
        self.dispatcher.count_routed(flush=not self.scheduler.has_unfinished())
        for req in updated:
            if req.finished:
                self.runner.release(req.request_id)
        drafted = [len(s.draft_ids) for s in plan.scheduled if s.draft_ids]
        # the drafts kept of the requests that drafted (a burst's tokens come back as kept
        # drafts too, runner.py, but were never drafted: a burst's step drafts nothing)
        ids = [s.request.request_id for s in plan.scheduled if s.draft_ids]
        lengths = [len(done.kept.get(rid, ())) for rid in ids]
        kept = sum(lengths)
        drafts = (len(drafted), sum(drafted), kept)
        kept_at = tuple(sum(n > i for n in lengths) for i in range(max(lengths, default=0)))
        if drafted and self.scheduler.drafter is not None:  # how far each guesses next
            for s in plan.scheduled:
                if s.draft_ids:
                    rid = s.request.request_id
                    n = len(done.kept.get(rid, ()))
                    self.scheduler.drafter.verified(rid, len(s.draft_ids), n)
        return StepResult(updated, tokens, self.dispatcher.timing, drafts=drafts, kept_at=kept_at)

    @property
    def paused(self) -> bool:
        """Steps are held for an expert shard with no live replica."""
        return self._outage_since is not None and self._within_grace()

    def _within_grace(self) -> bool:
        assert self._outage_since is not None
        return time.monotonic() - self._outage_since < self.cfg.ffn_grace_s

    def _hold(self) -> bool:
        """Whether steps must wait for the FFN pool: some shard has no live replica and the
        grace period, counted from when the pool lost it, is not over."""
        missing = self.replicas.uncovered()
        if not missing:
            if self._outage_since is not None:
                log.warning(
                    "every expert shard has a live FFN replica again after %.1fs: resuming",
                    time.monotonic() - self._outage_since,
                )
                self._outage_since = None
            return False
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            if self.cfg.ffn_grace_s > 0:
                log.warning(
                    "FFN shard %s has no live replica: pausing %d requests for up to %.0fs "
                    "(--ffn-grace)",
                    ", ".join(map(str, missing)),
                    self.scheduler.num_running + self.scheduler.num_waiting,
                    self.cfg.ffn_grace_s,
                )
        return self._within_grace()

    def _fail(self, plan, error: AfdError) -> list[Request]:
        """A step that could not be computed (the FFN pool could not serve it, or the device
        ran out of memory): its requests end with a typed error, the engine itself keeps
        serving the rest."""
        log.error("step failed, failing %d requests: %s", len(plan.scheduled), error)
        return self._fail_requests([s.request for s in plan.scheduled], error)

    def _fail_requests(self, reqs: list[Request], error: AfdError) -> list[Request]:
        """End these requests with a typed error; the others go on."""
        failed = []
        for req in reqs:
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
