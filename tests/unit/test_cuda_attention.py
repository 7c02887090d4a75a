"""afd's Triton paged decode attention (the CUDA decode path), checked without a GPU: its
kernels run through Triton's interpreter on CPU tensors in a child process
(tests/helpers/triton_interpret.py) against the torch path, for GQA, MFA, MLA's latent (V a view
of K), gpt-oss's sinks and sliding window, one split of the keys and three. On a GPU, tests/gpu
runs it inside every family's greedy check."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)
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
    assert len(errors) == 10
    for case, err in errors.items():
        bound = BOUND["bf16" if "bf16" in case else "fp32"]
        assert err < bound, f"{case}: relative error {err:.2e} over {bound:.0e}"
