"""The model runner: executes one scheduler plan and samples the next tokens."""

from __future__ import annotations

import torch

from afd.control import Logprob
from services.attention import batch
from services.attention.dispatch import FFNDispatcher
from services.attention.kv_cache import KVCache
from services.attention.model import AttentionModel
from services.attention.pipeline import run_layers
from services.attention.sampler import sample
from services.attention.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: AttentionModel,
        cache: KVCache,
        dispatcher: FFNDispatcher,
        micro_batches: int,
    ):
        self.model = model
        self.cache = cache
        self.dispatcher = dispatcher
        self.micro_batches = micro_batches
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> tuple[dict[str, int], dict[str, Logprob]]:
        groups = batch.split(plan.scheduled, self.micro_batches)
        mbs = [batch.build(g, self.cache.block_size) for g in groups]

        def head(m: int, h: torch.Tensor) -> torch.Tensor:  # [T_m, H] -> [B_m, V] float32
            rows = mbs[m].sample_rows
            return self.model.logits(h.index_select(0, rows)) if len(rows) else h.new_empty(0)

        per_mb = run_layers(self.model, self.cache, self.dispatcher, mbs, head)
        seqs = [s for mb in mbs for s in mb.sample_seqs]
        if not seqs:
            return {}, {}
        parts = [x for x in per_mb if x.numel()]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # [B, V] float32
        params = [s.request.sampling for s in seqs]
        gens = [self._generator(s.request.request_id, s.request.sampling.seed) for s in seqs]
        tokens, lps = sample(logits, params, gens)
        sampled = {s.request.request_id: t for s, t in zip(seqs, tokens, strict=True)}
        logprobs = {
            s.request.request_id: lp for s, lp in zip(seqs, lps, strict=True) if lp is not None
        }
        return sampled, logprobs

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
