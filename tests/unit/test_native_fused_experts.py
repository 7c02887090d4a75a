"""The fused experts calls (moe.c on bf16 weights, mxfp4_moe.c on MXFP4 ones) against the torch
path they replace (services/ffn/experts.py's loop over experts, each matmul on afd's kernel for
that weight): the same bits, with and without biases, for both activations they compute, on
every native kernel path."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from afd.mxfp4 import MXFP4, quantize
from afd.ops import Linear
from services.ffn.experts import ExpertGroup, MLPWeights, routed_experts
from services.ffn.kinds import swiglu, swiglu_clamped
from tests.helpers.kernels import NATIVE, NO_NATIVE

H, INTER, E, K = 64, 96, 6, 3  # INTER: 3 blocks of 32, an odd last block on the w2 side

ACTS = {
    "swiglu": swiglu,
    "swiglu_clamped": partial(swiglu_clamped, limit=7.0, alpha=1.702),
}
PATHS = NATIVE or [pytest.param("none", marks=NO_NATIVE)]


def _experts(fmt: str, seed: int, biased: bool, act: str, first: int = 2) -> ExpertGroup:
    g = torch.Generator().manual_seed(seed)

    def lin(n: int, k: int) -> Linear:
        w = torch.randn(n, k, generator=g) * 0.3
        b = torch.randn(n, generator=g).bfloat16() if biased else None
        return Linear(MXFP4(*quantize(w)) if fmt == "mxfp4" else w.bfloat16(), b)

    w13 = [lin(2 * INTER, H) for _ in range(E)]
    w2 = [lin(H, INTER) for _ in range(E)]
    return ExpertGroup.build(first, w13, w2, ACTS[act])


def _unfused(group: ExpertGroup) -> ExpertGroup:
    return replace(group, native=None, fused_mx=None)


def _routing(seed: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 2).bfloat16()
    # global ids 0..E+3: some below and above this shard's 2..E+1
    ids = torch.stack([torch.randperm(E + 4, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return x, ids, w


@pytest.mark.parametrize("kernel_path", PATHS)
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("biased", [True, False])
def test_fused_experts_give_the_torch_paths_bits(kernel_path, fmt, act, biased):
    from afd.kernels import paths

    with paths.use(kernel_path):
        group = _experts(fmt, 1, biased, act)
        assert (group.fused_mx if fmt == "mxfp4" else group.native) is not None
        loop = _unfused(group)
        for T in (1, 5, 33):
            x, ids, w = _routing(T, T)
            base = (torch.randn(T, H) * 0.1).bfloat16()
            fused = routed_experts(x, ids, w, group, base.clone())
            want = routed_experts(x, ids, w, loop, base.clone())
            assert not torch.equal(want, base)
            assert torch.equal(fused, want), (T, (fused != want).sum().item())


@pytest.mark.parametrize("kernel_path", PATHS)
def test_planted_bias_dropped_is_caught(kernel_path, monkeypatch):
    """The comparison above can fail: either fused call without its gate|up biases differs."""
    from afd.kernels import paths

    # afd's matmul at every batch size: on a CPU with AMX, oneDNN's measured crossover (noisy
    # on a busy machine) can be below these 5 rows, and the fused call then never runs
    monkeypatch.setenv("AFD_ONEDNN_FROM_ROWS", "0")
    with paths.use(kernel_path):
        for fmt in ("bf16", "mxfp4"):
            group = _experts(fmt, 1, True, "swiglu_clamped")
            if fmt == "mxfp4":
                p = group.fused_mx._p
                monkeypatch.setattr(group.fused_mx, "_p", [*p[:2], None, *p[3:]])
            else:
                monkeypatch.setattr(group.native, "_pb13", None)
            x, ids, w = _routing(5, 5)
            base = torch.zeros(5, H, dtype=torch.bfloat16)
            fused = routed_experts(x, ids, w, group, base.clone())
            want = routed_experts(x, ids, w, _unfused(group), base.clone())
            assert not torch.equal(fused, want), fmt


@pytest.mark.parametrize("kernel_path", PATHS)
def test_the_decode_stack_is_offered_the_call_the_shard_would_make(kernel_path):
    """gpt-oss's experts (biases, the clamped SwiGLU; bf16 or MXFP4 as stored) go to the
    decode stack (decode_stack.c calls both); MXFP4 at every batch size, as routed_experts
    takes the fused MXFP4 call at every size."""
    from afd.kernels import paths
    from services.ffn.engine import FFNEngine

    with paths.use(kernel_path):
        for fmt in ("bf16", "mxfp4"):
            group = _experts(fmt, 1, True, "swiglu_clamped")
            engine = FFNEngine.__new__(FFNEngine)
            engine.experts, engine.shared, engine.dense = {0: group}, {}, {}
            engine.inject_delay_s, engine.dtype = 0.0, torch.bfloat16
            engine.device = torch.device("cpu")
            offered = engine.inline_experts(0)
            assert offered is not None, fmt
            if fmt == "mxfp4":
                assert offered.native is group.fused_mx
                assert offered.rows_below == paths.NEVER
            else:
                assert offered.native is group.native
            # a shared expert: offered with its native call (mlp.c, as the shard adds it) ...
            H = group.w13[0].in_features
            w13, w2 = torch.randn(64, H).to(torch.bfloat16), torch.randn(H, 32).to(torch.bfloat16)
            shared = MLPWeights(Linear(w13), Linear(w2))
            engine.shared = {0: shared}
            offered = engine.inline_experts(0)
            assert offered is not None and offered.shared is shared.native is not None
            # ... and none where the shard would compute it otherwise (torch's matmuls)
            with paths.use("torch"):
                engine.shared = {0: MLPWeights(Linear(w13), Linear(w2))}
            assert engine.shared[0].native is None and engine.inline_experts(0) is None


@pytest.mark.parametrize("kernel_path", PATHS)
@pytest.mark.parametrize("pool_experts", [2, 100])
def test_workspace_experts_fused_give_the_loops_bits(kernel_path, pool_experts):
    """MXFP4 experts converted into the workspace, then one fused call over them: the same bits
    as the loop over the same converted experts, with a pool of two experts (smaller than one
    call's) and one that holds them all."""
    from afd.kernels import paths
    from services.ffn.workspace import ExpertWorkspace

    with paths.use(kernel_path):
        dense = _experts("mxfp4", 1, True, "swiglu_clamped")
        expert_bytes = 3 * H * INTER * 2
        pool = ExpertWorkspace(pool_experts * expert_bytes + 1024)
        group = ExpertGroup.build(2, dense.w13, dense.w2, dense.act, workspace=pool, layer=0)
        assert group.ws_fused is not None and group.fused_mx is None
        loop = replace(group, ws_fused=None)
        for T in (1, 5, 33):
            x, ids, w = _routing(T, T)
            base = (torch.randn(T, H) * 0.1).bfloat16()
            fused = routed_experts(x, ids, w, group, base.clone())
            assert group.ws_call, "the fused call did not run"
            want = routed_experts(x, ids, w, loop, base.clone())
            assert torch.equal(fused, want), (T, (fused != want).sum().item())
