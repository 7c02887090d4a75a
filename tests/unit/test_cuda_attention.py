"""afd's Triton paged decode attention (the CUDA decode path), checked without a GPU: its
kernels run through Triton's interpreter on CPU tensors in a child process
(tests/helpers/triton_interpret.py) against the torch path, for GQA, MFA, MLA's latent (V a view
of K), gpt-oss's sinks and sliding window, one split of the keys and three. On a GPU, tests/gpu
runs it inside every family's greedy check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]
# float32 is exact to rounding; bf16 rounds the probabilities and the output to 8 bits
BOUND = {"fp32": 1e-5, "bf16": 1.5e-2}


def _errors(seed: int = 0) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.triton_interpret", str(seed)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return {line.split()[0]: float(line.split()[1]) for line in run.stdout.splitlines()}


def test_triton_decode_attention_equals_the_torch_path():
    errors = _errors()
    assert len(errors) == 14
    for case, err in errors.items():
        bound = BOUND["bf16" if "bf16" in case else "fp32"]
        assert err < bound, f"{case}: relative error {err:.2e} over {bound:.0e}"


# Shapes the families decode with: (D, Dv, query heads per K/V head, dtype, FP8 cache)
COMPILED = [
    (64, 64, 4, torch.bfloat16, False),  # GQA (the bench model, Qwen3-MoE, Mixtral)
    (256, 256, 64, torch.bfloat16, False),  # MFA (Step-3)
    (256, 256, 64, torch.bfloat16, True),  # MFA over an FP8 cache
    # MLA's latent (DeepSeek), V in K: its wide tiles take ~12 s to compile
    pytest.param(576, 512, 128, torch.bfloat16, False, marks=pytest.mark.slow),
    (64, 64, 8, torch.float32, False),  # float32 compute
]


@pytest.mark.parametrize("D,Dv,group,dtype,fp8", COMPILED, ids=lambda v: str(v))
def test_the_kernels_compile_for_the_h200(D, Dv, group, dtype, fp8):
    """Compiled ahead of time for sm_90 (Triton's own ptxas; no GPU needed), with the tile
    sizes decode_attention launches: a kernel that only the interpreter runs is not enough."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from afd.kernels import cuda_attention as ca
    from afd.kernels import triton_attention as tk

    target = GPUTarget("cuda", 90, 32)
    el = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    consts = ca.partial_constexprs(D, Dv, 16, group, dtype, fp8)
    kv = "*fp8e4nv" if fp8 else f"*{el}"
    types = [f"*{el}", kv, kv, "*fp32", "*fp32", "*i64", "*i64"] + ["*fp32"] * 3 + ["fp32"]
    types += ["i32"] * 4 + ["i64"] * 11
    sig = dict(zip(tk.partial.arg_names, [*types, *["constexpr"] * len(consts)], strict=True))
    options = ca.COMPILE_OPTIONS
    kernel = triton.compile(ASTSource(tk.partial, sig, consts), target=target, options=options)
    assert kernel.metadata.shared <= 227 * 1024  # an H200 multiprocessor's shared memory
    merge = ca.merge_constexprs(Dv, 64, True)
    types = ["*fp32"] * 4 + [f"*{el}", "i32", "i32", "i64"]
    sig = dict(zip(tk.merge.arg_names, [*types, *["constexpr"] * len(merge)], strict=True))
    triton.compile(ASTSource(tk.merge, sig, merge), target=target, options=options)
