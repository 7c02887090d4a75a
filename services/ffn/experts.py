"""MoE compute on the FFN side: routed experts grouped by expert, shared expert, dense MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.kernels.moe import NativeExperts
from afd.ops import Linear
from services.ffn.kinds import Activation, mlp, swiglu
from services.ffn.workspace import ExpertWorkspace


@dataclass(frozen=True)
class MLPWeights:
    w13: Linear  # [2I, H]: gate rows then up rows
    w2: Linear  # [H, I]
    act: Activation = swiglu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return mlp(x, self.w13, self.w2, self.act)


@dataclass(frozen=True)
class ExpertGroup:
    """The experts of one layer that this shard holds: global ids first .. first + n - 1."""

    first: int
    w13: list[Linear]  # n x [2I, H]
    w2: list[Linear]  # n x [H, I]
    act: Activation = swiglu
    native: NativeExperts | None = None  # the fused native call, where the kernels run
    # MXFP4 experts converted on use into this shared pool (else multiplied as stored)
    workspace: ExpertWorkspace | None = None
    layer: int = -1

    @staticmethod
    def build(
        first: int,
        w13: list[Linear],
        w2: list[Linear],
        act: Activation = swiglu,
        workspace: ExpertWorkspace | None = None,
        layer: int = -1,
    ) -> ExpertGroup:
        weights13, weights2 = [lin.w for lin in w13], [lin.w for lin in w2]
        plain = act is swiglu and all(lin.bias is None for lin in (*w13, *w2))
        native = (
            plain
            and all(lin.native for lin in (*w13, *w2))
            and NativeExperts.usable(weights13, weights2)
        )
        fused = NativeExperts(weights13, weights2, w13[0].isa) if native else None
        return ExpertGroup(first, w13, w2, act, fused, workspace, layer)

    @property
    def count(self) -> int:
        return len(self.w13)

    def expert(self, e: int, dtype: torch.dtype) -> tuple[Linear, Linear]:
        """Local expert e's (w13, w2) as they are multiplied: from the workspace, if any."""
        if self.workspace is None:
            return self.w13[e], self.w2[e]
        return self.workspace.get(
            (self.layer, e), lambda: (_expand(self.w13[e], dtype), _expand(self.w2[e], dtype))
        )


def _expand(lin: Linear, dtype: torch.dtype) -> Linear:
    """A quantized weight's Linear -> the same weight converted to `dtype`, on the dense path."""
    return Linear(lin.mx.dequantize(dtype), lin.bias) if lin.mx is not None else lin


def routed_experts(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k] int, global ids
    expert_weights: torch.Tensor,  # [T, k]
    group: ExpertGroup,
    out: torch.Tensor,  # [T, H], accumulated into
) -> torch.Tensor:
    """out[t] += sum over t's experts held here of w * expert(x[t]).

    Token-expert pairs are sorted by expert so each expert runs one matmul over all its tokens;
    experts held by other shards are skipped. The sum is accumulated in expert order (as the
    Hugging Face reference does) with one index_add_.
    """
    T, k = expert_ids.shape
    # from as many rows per expert as oneDNN's matmul is faster from, the Linears take over
    native = group.native is not None and group.w13[0].ours(T * k // group.count)
    if native and out.is_contiguous() and x.dtype == out.dtype == torch.bfloat16:
        # one call: the pair sorting below, the experts and the sum, with the same roundings
        group.native(x, expert_ids, expert_weights, group.first, out)
        return out
    local = expert_ids.reshape(-1).long() - group.first  # [T*k]
    held = (local >= 0) & (local < group.count)
    if not bool(held.any()):
        return out
    pair = torch.nonzero(held).squeeze(1)  # [P] indices into the flattened [T*k]
    local = local[pair]
    order = torch.argsort(local, stable=True)
    pair, local = pair[order], local[order]
    tokens = pair // k  # [P]
    counts = torch.bincount(local, minlength=group.count).tolist()  # [E] pairs per local expert
    xs = x.index_select(0, tokens)  # [P, H]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            w13, w2 = group.expert(e, x.dtype)
            ys[start : start + n] = mlp(xs[start : start + n], w13, w2, group.act)
            start += n
    w = expert_weights.reshape(-1)[pair].to(ys.dtype).unsqueeze(1)  # [P, 1]
    out.index_add_(0, tokens, ys * w)
    return out
