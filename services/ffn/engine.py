"""The FFN side's compute: one expert shard's weights, and (layer, requests) -> outputs.

It holds no per-request state, so its server can restart at any time without losing a
request. Validation, deadlines, draining, timing traces and metrics belong to the serving loop
(afd/transport/serving.py), the same for every transport.
"""

from __future__ import annotations

import logging
import time

import torch

from afd import hugepages
from afd.blockfp8 import BlockFP8, cat_rows
from afd.checkpoint import load_weights
from afd.config import ExpertConfig, ModelConfig
from afd.device import CPU, place, to_device
from afd.kernels import mxfp4 as native_mxfp4
from afd.kernels import paths
from afd.kernels.moe import InlineExperts
from afd.messages import FFNRequest
from afd.ops import Linear
from afd.quant import dequantize_fp8
from afd.runtime import release_load_memory, tune_allocator
from afd.sharding import ExpertShard
from services.ffn.experts import ExpertGroup, MLPWeights, routed_experts
from services.ffn.kinds import activation
from services.ffn.workspace import ExpertWorkspace

log = logging.getLogger("afd.ffn")


class FFNEngine:
    def __init__(
        self,
        cfg: ModelConfig,
        shard: ExpertShard,
        dtype: torch.dtype = torch.bfloat16,
        weights: dict[str, torch.Tensor] | None = None,
        progress: bool = True,
        inject_delay_s: float = 0.0,
        experts: ExpertConfig | None = None,
        device: torch.device = CPU,
    ):
        tune_allocator()
        self.cfg = cfg
        self.device = device
        # Fault injection (tests): extra seconds inside every layer call's compute window, so
        # this server looks like a slow FFN to the attention side's straggler detection.
        self.inject_delay_s = inject_delay_s
        self.shard = shard
        self.dtype = dtype
        # Our own dict, each weight popped as its Linear takes a re-laid-out copy: a loaded
        # original is freed at once, so loading peaks at the weights plus one tensor.
        w = (
            dict(weights)
            if weights is not None
            else load_weights(cfg, "ffn", dtype, shard, progress)
        )
        place(w, device)
        self.experts: dict[int, ExpertGroup] = {}
        self.shared: dict[int, MLPWeights] = {}
        self.dense: dict[int, MLPWeights] = {}
        act = activation(cfg)
        experts = experts or ExpertConfig()
        self.expert_compute = _expert_compute(cfg, experts)
        self.workspace = (
            ExpertWorkspace(int(experts.workspace_mb * (1 << 20)))
            if self.expert_compute == "workspace"
            else None
        )
        for i in range(cfg.num_layers):
            if cfg.is_moe(i):
                ids = range(shard.start, shard.end)
                self.experts[i] = ExpertGroup.build(
                    first=shard.start,
                    w13=[_gate_up(w, f"layers.{i}.experts.{e}") for e in ids],
                    w2=[_down(w, f"layers.{i}.experts.{e}") for e in ids],
                    act=act,
                    workspace=self.workspace,
                    layer=i,
                )
                if cfg.shared_expert_intermediate_size and shard.owns_dense:
                    self.shared[i] = _mlp(w, f"layers.{i}.shared", act)
            elif shard.owns_dense:
                self.dense[i] = _mlp(w, f"layers.{i}.mlp", act)
        del w
        release_load_memory()
        if device.type == "cpu":  # the experts, streamed from DRAM every step: in 2 MiB pages
            hugepages.back_loaded()
        if cfg.mxfp4_experts:
            log.info("MXFP4 experts, computed %s", self.expert_compute)

    def compute(self, layer: int, group: list[FFNRequest]) -> list[torch.Tensor]:
        """The partial outputs [T_i, H] of one layer's requests (validated by the serving
        loop), computed as one batch: the experts this shard holds, plus the shared expert
        and dense MLP where it is responsible for them."""
        outputs = self._compute(layer, group)
        if self.inject_delay_s:
            time.sleep(self.inject_delay_s)
        return outputs

    def inline_experts(self, layer: int) -> InlineExperts | None:
        """This layer's experts for a caller in this process that computes the decode step
        natively (the attention side's decode stack), where compute() would answer a bf16
        message with that call alone (and its shared expert's native call, where it has one;
        a dense layer's MLP where that is one native call): no injected delay, bf16 on the CPU.
        None where anything else would run."""
        g = self.experts.get(layer)
        if self.inject_delay_s or self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return None
        if g is None:  # a dense layer: its MLP in one native call, where it has one
            m = self.dense.get(layer)
            if m is None or m.native is None:
                return None
            return InlineExperts(None, 0, paths.NEVER, m.native, m.native_below)
        shared, shared_rows = None, 0
        if layer in self.shared:  # added by the same call as mlp.add_into adds it (mlp.c)
            m = self.shared[layer]
            shared, shared_rows = m.native, m.native_below
            if shared is None:
                return None
        if g.fused_mx is not None and native_mxfp4.usable():  # routed_experts' first choice,
            # at every batch size
            return InlineExperts(g.fused_mx, g.first, paths.NEVER, shared, shared_rows)
        if g.native is None or g.workspace is not None:
            return None
        return InlineExperts(g.native, g.first, g.w13[0].onednn_from, shared, shared_rows)

    def _compute(self, layer: int, group: list[FFNRequest]) -> list[torch.Tensor]:
        """The requests' tensors go to this engine's device (wire bytes before the FP8 decode:
        fewer to copy) and the outputs go back where the requests came from: the host for
        every message, the device itself for an in-process caller on it (afd/device.py)."""
        dev = self.device
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
            ids, wts = to_device(ids, dev), to_device(wts, dev)
            routed_experts(x, ids, wts, self.experts[layer], out)
        mlp = self.shared.get(layer) or self.dense.get(layer)
        if mlp is not None:
            _add_dense(mlp, x, out, group)
        reply_dtype = torch.float32 if group[0].hidden.dtype == torch.float32 else torch.bfloat16
        if out.dtype != reply_dtype:
            out = out.to(reply_dtype)
        out = to_device(out, group[0].hidden.device)
        return [out] if len(group) == 1 else list(out.split([r.num_tokens for r in group]))

    def _dequant(self, r: FFNRequest) -> torch.Tensor:
        hidden = to_device(r.hidden, self.device)
        if hidden.dtype == torch.float8_e4m3fn:
            return dequantize_fp8(hidden, to_device(r.scales, self.device), self.dtype)
        return hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)


def _add_dense(mlp: MLPWeights, x: torch.Tensor, out: torch.Tensor, group: list[FFNRequest]):
    """out += the shared expert's (or the dense MLP's) output, on the rows of the requests
    that leave it to this server (in an elastic pool one member computes it)."""
    if not any(r.skip_dense for r in group):
        mlp.add_into(x, out)  # [T, H]
        return
    rows, start = [], 0
    for r in group:
        if not r.skip_dense:
            rows.append(torch.arange(start, start + r.num_tokens, device=x.device))
        start += r.num_tokens
    if rows:
        idx = torch.cat(rows)
        out.index_add_(0, idx, mlp(x.index_select(0, idx)))


def _expert_compute(cfg: ModelConfig, experts: ExpertConfig) -> str:
    """How MXFP4 experts are multiplied here ("" where they are not MXFP4). auto is direct on
    every CPU: it was the faster path at batch 1 and 32 where measured (docs/benchmarks.md;
    the workspace saves no bytes per step and converts whatever its pool cannot hold)."""
    if not cfg.mxfp4_experts:
        return ""
    return "direct" if experts.compute == "auto" else experts.compute


def _gate_up(w: dict, base: str) -> Linear:
    """gate and up [I, H] (and their biases, where the model has them) as one [2I, H]."""
    weight: torch.Tensor | BlockFP8 = cat_rows([w.pop(f"{base}.gate"), w.pop(f"{base}.up")])
    bias = None
    if f"{base}.gate_bias" in w:
        bias = torch.cat([w.pop(f"{base}.gate_bias"), w.pop(f"{base}.up_bias")])
    return Linear(weight, bias)


def _down(w: dict, base: str) -> Linear:
    return Linear(w.pop(f"{base}.down"), w.pop(f"{base}.down_bias", None))


def _mlp(w: dict, base: str, act) -> MLPWeights:
    return MLPWeights(_gate_up(w, base), _down(w, base), act)
