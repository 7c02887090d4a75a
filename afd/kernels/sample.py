"""Sampling inside a native call (sample.c): the draw of services/attention/sampler.py's
temperature, min-p, top-k and top-p, from a uniform number the caller drew, so that a burst
(decode_stack.c) can sample each step's token without coming back to Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from afd.kernels import gemm
from afd.sampling import SamplingParams


@dataclass(frozen=True)
class Draws:
    """Each row's sampling parameters and each step's uniform numbers, as sample.c reads them;
    a greedy row has temperature 0 (its argmax stands)."""

    temperature: torch.Tensor  # [T] float32
    top_k: torch.Tensor  # [T] int32, <= 0: off
    top_p: torch.Tensor  # [T] float32, 1: off
    min_p: torch.Tensor  # [T] float32, 0: off
    uniform: torch.Tensor  # [steps, T] float32 in [0, 1)

    @staticmethod
    def of(params: Sequence[SamplingParams], steps: int) -> Draws | None:
        """The rows' draws for `steps` steps, the uniform numbers from torch's global generator
        (rows without a seed of their own); None where every row is greedy."""
        if all(p.greedy for p in params):
            return None
        return Draws(
            torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
            torch.tensor([p.top_k for p in params], dtype=torch.int32),
            torch.tensor([p.top_p for p in params]),
            torch.tensor([p.min_p for p in params]),
            torch.rand(steps, len(params)),
        )

    def args(self) -> tuple[int, ...]:
        return tuple(
            t.data_ptr()
            for t in (self.temperature, self.top_k, self.top_p, self.min_p, self.uniform)
        )


def rows(
    logits: torch.Tensor,  # [T, V] float32, contiguous
    draws: Draws,  # its steps: 1
    out: torch.Tensor,  # [T] int64: the greedy rows' tokens (kept), the others' written
) -> torch.Tensor:
    T, V = logits.shape
    temperature, top_k, top_p, min_p, uniform = draws.args()
    rc = gemm._lib().afd_sample_rows(
        logits.data_ptr(), T, V, temperature, top_k, top_p, min_p, uniform, out.data_ptr()
    )
    if rc:
        raise RuntimeError(f"afd_sample_rows failed ({rc}) for {tuple(logits.shape)}")
    return out
