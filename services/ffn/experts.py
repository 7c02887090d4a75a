"""MoE compute on the FFN side: routed experts grouped by expert, shared expert, dense MLP."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afd.kernels import mxfp4 as native_mxfp4
from afd.kernels.mlp import NativeMLP
from afd.kernels.moe import ActSpec, NativeExperts
from afd.ops import Linear
from services.ffn.kinds import Activation, mlp, native_spec, swiglu
from services.ffn.workspace import ExpertWorkspace


@dataclass(frozen=True)
class MLPWeights:
    w13: Linear  # [2I, H]: gate rows then up rows
    w2: Linear  # [H, I]
    act: Activation = swiglu
    # the same MLP in one native call (mlp.c), where both matmuls are afd's kernels: what
    # add_into runs at the rows they take, and what the decode stack runs (stack.py)
    native: NativeMLP | None = field(init=False, default=None)

    def __post_init__(self):
        w13, w2, spec = self.w13, self.w2, native_spec(self.act)
        biased = w13.bias is not None or w2.bias is not None
        isa = w13.kernel_path  # (block-FP8 weights: the call converts them for it)
        if spec is None or biased or isa is None or isa != w2.kernel_path:
            return
        if NativeMLP.usable(w13.w, w2.w):
            object.__setattr__(self, "native", NativeMLP(w13.w, w2.w, isa, spec))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return mlp(x, self.w13, self.w2, self.act)

    @property
    def native_below(self) -> int:
        """The rows of x below which `native` runs (its matmuls' rule, ops.Linear.ours)."""
        return min(self.w13.onednn_from, self.w2.onednn_from)

    def add_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, H] += the MLP of x [T, H], in place."""
        n = self.native
        cpu_bf16 = x.dtype == out.dtype == torch.bfloat16 and x.device.type == "cpu"
        if n is not None and cpu_bf16 and x.shape[0] < self.native_below:
            n.add_into(x.contiguous(), out)
            return
        out += self(x)


@dataclass(frozen=True)
class Stacked:
    """A layer's experts as one tensor each, for grouped matmuls: the torch path's layout
    (every device), where each expert's Linear multiplies a view of these."""

    w13: torch.Tensor  # [n, 2I, H]
    w2: torch.Tensor  # [n, H, I]
    b13: torch.Tensor | None  # [n, 2I]
    b2: torch.Tensor | None  # [n, H]

    @staticmethod
    def of(w13: list[Linear], w2: list[Linear]) -> Stacked | None:
        """The stack, where every weight is a dense tensor on torch's matmul (else None)."""
        lins = (*w13, *w2)
        if not all(lin.matmul == "torch" and isinstance(lin.w, torch.Tensor) for lin in lins):
            return None
        biased = [lin.bias is not None for lin in lins]
        if any(biased) and not all(biased):
            return None
        return Stacked(
            torch.stack([lin.w for lin in w13]),
            torch.stack([lin.w for lin in w2]),
            torch.stack([lin.bias for lin in w13]) if biased[0] else None,
            torch.stack([lin.bias for lin in w2]) if biased[0] else None,
        )

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether torch's grouped matmul takes x's dtype and layout on x's device (CUDA's
        wants bf16 and rows in whole 16 bytes; the CPU's takes any)."""
        if x.device.type == "cpu":
            return True
        n, two_i, h = self.w13.shape
        return x.dtype == torch.bfloat16 and h % 8 == 0 and two_i % 16 == 0


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
    stacked: Stacked | None = None  # the torch path's experts as stacks (grouped matmuls)
    fused_mx: native_mxfp4.FusedExperts | None = None  # MXFP4 experts in one native call
    # with a workspace: the activation and biases for a fused call over its converted
    # experts, and that call once made (rebound to each call's weights)
    ws_fused: tuple | None = None
    ws_call: list = field(default_factory=list)

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
        spec, biases = native_spec(act), _biases(w13, w2)
        # one afd kernel path for all (dense weights laid out for it, or block-FP8 ones it
        # converts as it goes)
        isa = {lin.kernel_path for lin in (*w13, *w2)}
        native = (
            spec is not None
            and biases is not None
            and len(isa) == 1
            and None not in isa
            and NativeExperts.usable(weights13, weights2)
        )
        fused = NativeExperts(weights13, weights2, *isa, *biases, act=spec) if native else None
        stacked = Stacked.of(w13, w2) if workspace is None else None
        if stacked is not None:  # each Linear multiplies its slice of the stack: one copy
            w13 = [Linear(stacked.w13[e], lin.bias) for e, lin in enumerate(w13)]
            w2 = [Linear(stacked.w2[e], lin.bias) for e, lin in enumerate(w2)]
        fused_mx = _fused_mxfp4(w13, w2, spec, biases) if workspace is None else None
        usable = workspace is not None and spec is not None and biases is not None
        ws_fused = (spec, biases) if usable else None
        return ExpertGroup(
            first, w13, w2, act, fused, workspace, layer, stacked, fused_mx, ws_fused
        )

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


def _biases(
    w13: list[Linear], w2: list[Linear]
) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None] | None:
    """The experts' biases as the fused calls take them: (None, None) where none has one, None
    where only some have."""
    biased = [lin.bias is not None for lin in (*w13, *w2)]
    if not any(biased):
        return None, None
    if not all(biased):
        return None
    return [lin.bias for lin in w13], [lin.bias for lin in w2]


def _fused_mxfp4(
    w13: list[Linear], w2: list[Linear], spec: ActSpec | None, biases
) -> native_mxfp4.FusedExperts | None:
    """The fused native call for MXFP4 experts multiplied as stored, where it computes them."""
    if spec is None or biases is None or not all(lin.mx is not None for lin in (*w13, *w2)):
        return None
    m13, m2 = [lin.mx for lin in w13], [lin.mx for lin in w2]
    if not native_mxfp4.FusedExperts.usable(m13, m2):
        return None
    return native_mxfp4.FusedExperts(m13, m2, *biases, spec)


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
    fused_mx = group.fused_mx is not None and native_mxfp4.usable()
    if fused_mx and out.is_contiguous() and x.dtype == out.dtype == torch.bfloat16:
        group.fused_mx(x, expert_ids, expert_weights, group.first, out)  # the loop below, fused
        return out
    ws_bf16 = group.ws_fused is not None and x.dtype == out.dtype == torch.bfloat16
    if (
        ws_bf16
        and out.is_contiguous()
        and _workspace_fused(x, expert_ids, expert_weights, group, out)
    ):
        return out
    # from as many rows per expert as oneDNN's matmul is faster from, the Linears take over
    native = group.native is not None and group.w13[0].ours(T * k // group.count)
    if native and out.is_contiguous() and x.dtype == out.dtype == torch.bfloat16:
        # one call: the pair sorting below, the experts and the sum, with the same roundings
        group.native(x, expert_ids, expert_weights, group.first, out)
        return out
    if group.stacked is not None and group.stacked.grouped(x):
        return _grouped(x, expert_ids, expert_weights, group, group.stacked, out)
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


def _workspace_fused(
    x: torch.Tensor,  # [T, H] bf16
    expert_ids: torch.Tensor,  # [T, k] int, global ids
    expert_weights: torch.Tensor,  # [T, k]
    group: ExpertGroup,
    out: torch.Tensor,  # [T, H] bf16, accumulated into
) -> bool:
    """The workspace's experts in one fused call (moe.c): every expert the call needs is
    fetched first (converted on a miss; one evicted meanwhile stays alive until the call
    ends), the experts it does not need point at one it does (no pair reads them). False,
    out untouched, where the converted weights are not on afd's kernels at this size."""
    T, k = expert_ids.shape
    local = expert_ids.reshape(-1).long() - group.first
    used = torch.unique(local[(local >= 0) & (local < group.count)]).tolist()
    if not used:
        return True
    got = {e: group.expert(e, x.dtype) for e in used}
    w13 = [got.get(e, got[used[0]])[0].w for e in range(group.count)]
    w2 = [got.get(e, got[used[0]])[1].w for e in range(group.count)]
    lins = [lin for pair in got.values() for lin in pair]
    if not (all(lin.native for lin in lins) and lins[0].ours(T * k // group.count)):
        return False
    if not NativeExperts.usable(w13, w2):
        return False
    if not group.ws_call:
        spec, (b13, b2) = group.ws_fused
        call = NativeExperts(w13, w2, lins[0].isa, b13, b2, act=spec)
        call.w13 = call.w2 = []  # the template holds no converted expert past the pool
        group.ws_call.append(call)
    group.ws_call[0].rebind(w13, w2, lins[0].isa)(x, expert_ids, expert_weights, group.first, out)
    return True


def _grouped(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k] int, global ids
    expert_weights: torch.Tensor,  # [T, k]
    group: ExpertGroup,
    st: Stacked,
    out: torch.Tensor,  # [T, H], accumulated into
) -> torch.Tensor:
    """routed_experts' sum as two grouped matmuls over every (token, expert) pair, with no
    value read back to the host (a GPU runs it without a sync): the pairs of experts held
    elsewhere sort last, past the last group, and add zero. Pairs are ordered as in the loop
    above (by expert, then token), so the sum is accumulated in the same order."""
    T, k = expert_ids.shape
    n = group.count
    local = expert_ids.reshape(-1).long() - group.first  # [T*k]
    held = (local >= 0) & (local < n)
    key = torch.where(held, local, n)  # [T*k]: n for pairs another shard computes
    order = torch.argsort(key, stable=True)  # [T*k]
    key, held = key[order], held[order]
    tokens = order // k
    # pairs per expert without bincount (on CUDA it reads the largest id back to the host)
    counts = torch.zeros(n + 1, dtype=torch.long, device=x.device).index_add_(
        0, key, torch.ones_like(key)
    )
    ends = counts[:n].cumsum(0).to(torch.int32)  # [n]: where each expert's rows end
    xs = x.index_select(0, tokens)  # [T*k, H]
    expert = key.clamp(max=n - 1)  # each row's expert (the unheld rows' is never used)
    h = torch._grouped_mm(xs, st.w13.transpose(1, 2), offs=ends)  # [T*k, 2I]
    if st.b13 is not None:
        h = h + st.b13.index_select(0, expert).to(h.dtype)
    gate, up = h.chunk(2, dim=-1)
    ys = torch._grouped_mm(group.act(gate, up), st.w2.transpose(1, 2), offs=ends)  # [T*k, H]
    if st.b2 is not None:
        ys = ys + st.b2.index_select(0, expert).to(ys.dtype)
    w = expert_weights.reshape(-1)[order].to(ys.dtype).unsqueeze(1)  # [T*k, 1]
    # rows past the last group are not written by the matmul: select, never multiply, them away
    out.index_add_(0, tokens, torch.where(held.unsqueeze(1), ys * w, 0))
    return out
