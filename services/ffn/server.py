"""The FFN server: owns nothing but weights. Each message in, one partial output out.

It holds no per-request state, so it can restart at any time without losing a request.
"""

from __future__ import annotations

import logging
import time

import torch

from afd.checkpoint import load_weights
from afd.config import ModelConfig
from afd.ops import Linear, swiglu
from afd.quant import dequantize_fp8
from afd.runtime import tune_allocator
from afd.sharding import ExpertShard
from afd.transport.messages import FFNReply, FFNRequest, Trace
from services.ffn.experts import ExpertGroup, MLPWeights, routed_experts

log = logging.getLogger("afd.ffn")


class FFNServer:
    def __init__(
        self,
        cfg: ModelConfig,
        shard: ExpertShard,
        dtype: torch.dtype = torch.bfloat16,
        weights: dict[str, torch.Tensor] | None = None,
        progress: bool = True,
        inject_delay_s: float = 0.0,
    ):
        tune_allocator()
        self.cfg = cfg
        # Fault injection (tests): extra seconds inside every layer call's compute window, so
        # this server looks like a slow FFN to the attention side's straggler detection.
        self.inject_delay_s = inject_delay_s
        # Set on SIGTERM (service.py): every message from then on gets a typed error reply.
        self.draining = False
        self.shard = shard
        self.dtype = dtype
        # Our own dict, each weight popped as its Linear takes a re-laid-out copy: a loaded
        # original is freed at once, so loading peaks at the weights plus one tensor.
        w = (
            dict(weights)
            if weights is not None
            else load_weights(cfg, "ffn", dtype, shard, progress)
        )
        self.experts: dict[int, ExpertGroup] = {}
        self.shared: dict[int, MLPWeights] = {}
        self.dense: dict[int, MLPWeights] = {}
        for i in range(cfg.num_layers):
            if cfg.is_moe(i):
                ids = range(shard.start, shard.end)
                self.experts[i] = ExpertGroup.build(
                    first=shard.start,
                    w13=[Linear(_cat_gate_up(w, f"layers.{i}.experts.{e}")) for e in ids],
                    w2=[Linear(w.pop(f"layers.{i}.experts.{e}.down")) for e in ids],
                )
                if cfg.shared_expert_intermediate_size and shard.owns_dense:
                    self.shared[i] = _mlp(w, f"layers.{i}.shared")
            elif shard.owns_dense:
                self.dense[i] = _mlp(w, f"layers.{i}.mlp")
        del w

    def handle(self, reqs: list[FFNRequest]) -> list[FFNReply]:
        """Compute a batch of requests; those of one layer are computed as one matmul batch."""
        t_recv = time.time()
        if self.draining:  # the attention side fails over at once on this code
            why = "FFN server is draining (shutting down)"
            return [_error(r, "unavailable", why, t_recv) for r in reqs]
        by_layer: dict[int, list[int]] = {}
        replies: list[FFNReply | None] = [None] * len(reqs)
        for j, r in enumerate(reqs):
            err = self._check(r)
            if err:
                replies[j] = _error(r, "bad_request", err, t_recv)
            else:
                by_layer.setdefault(r.layer, []).append(j)
        for layer, idx in by_layer.items():
            group = [reqs[j] for j in idx]
            try:
                t0 = time.time()
                outs = self._compute(layer, group)
                if self.inject_delay_s:
                    time.sleep(self.inject_delay_s)
                t1 = time.time()
            except Exception as e:  # a bad batch must not take the server down
                log.exception("FFN compute failed on layer %d", layer)
                for j in idx:
                    replies[j] = _error(reqs[j], "internal", f"FFN compute failed: {e}", t_recv)
                continue
            for j, out in zip(idx, outs, strict=True):
                r = reqs[j]
                trace = Trace(
                    a_send=r.t_send,
                    f_recv=t_recv,
                    f_compute_start=t0,
                    f_compute_end=t1,
                    f_send=time.time(),
                    merged=len(group),
                )
                replies[j] = FFNReply(r.seq, r.layer, r.micro_batch, out, trace=trace)
        return replies  # type: ignore[return-value]

    def _check(self, r: FFNRequest) -> str:
        cfg = self.cfg
        if not 0 <= r.layer < cfg.num_layers:
            return f"layer {r.layer} is outside 0..{cfg.num_layers - 1}"
        if r.hidden.dim() != 2 or r.hidden.shape[1] != cfg.hidden_size:
            return f"hidden states must be [T, {cfg.hidden_size}], got {list(r.hidden.shape)}"
        T = r.hidden.shape[0]
        k = cfg.top_k if cfg.is_moe(r.layer) else 0
        if tuple(r.expert_ids.shape) != (T, k) or tuple(r.expert_weights.shape) != (T, k):
            return f"expert ids/weights must be [{T}, {k}] on layer {r.layer}"
        if k and r.expert_ids.numel():
            lo, hi = torch.aminmax(r.expert_ids)
            if int(lo) < 0 or int(hi) >= cfg.num_experts:
                return f"expert id out of range 0..{cfg.num_experts - 1}"
        if r.hidden.dtype == torch.float8_e4m3fn and (r.scales is None or r.scales.shape != (T,)):
            return "fp8 hidden states need per-token scales [T]"
        return ""

    def _compute(self, layer: int, group: list[FFNRequest]) -> list[torch.Tensor]:
        x = (
            torch.cat([self._dequant(r) for r in group])
            if len(group) > 1
            else self._dequant(group[0])
        )
        out = torch.zeros_like(x)  # [T, H]
        if layer in self.experts:
            one = len(group) == 1
            ids = group[0].expert_ids if one else torch.cat([r.expert_ids for r in group])  # [T, k]
            wts = group[0].expert_weights if one else torch.cat([r.expert_weights for r in group])
            routed_experts(x, ids, wts, self.experts[layer], out)
        if layer in self.shared:
            out += _swiglu(x, self.shared[layer])
        if layer in self.dense:
            out += _swiglu(x, self.dense[layer])
        reply_dtype = torch.float32 if group[0].hidden.dtype == torch.float32 else torch.bfloat16
        out = out.to(reply_dtype)
        return [out] if len(group) == 1 else list(out.split([r.num_tokens for r in group]))

    def _dequant(self, r: FFNRequest) -> torch.Tensor:
        if r.hidden.dtype == torch.float8_e4m3fn:
            return dequantize_fp8(r.hidden, r.scales, self.dtype)
        return r.hidden.to(self.dtype)


def _swiglu(x: torch.Tensor, m: MLPWeights) -> torch.Tensor:
    return swiglu(x, m.w13, m.w2)


def _cat_gate_up(w: dict[str, torch.Tensor], base: str) -> torch.Tensor:
    return torch.cat([w.pop(f"{base}.gate"), w.pop(f"{base}.up")])  # [2I, H]


def _mlp(w: dict[str, torch.Tensor], base: str) -> MLPWeights:
    return MLPWeights(Linear(_cat_gate_up(w, base)), Linear(w.pop(f"{base}.down")))


def _error(r: FFNRequest, code: str, msg: str, t_recv: float) -> FFNReply:
    return FFNReply(
        r.seq, r.layer, r.micro_batch, None, code, msg, Trace(a_send=r.t_send, f_recv=t_recv)
    )
