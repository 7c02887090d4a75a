"""What the FFN dispatcher records of each step: where its time went (StepTiming, read by
the telemetry) and which experts its tokens were routed to (RoutedLoad, the [L, E] expert
load that is exported and that an elastic pool's placement balances)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from afd.device import to_host
from afd.messages import FFNReply

# Completed steps whose expert ids are added to the load at once: a step's count costs about
# as much as a batch-1 layer's router, and nothing needs it sooner.
_COUNT_STEPS = 32


@dataclass
class StepTiming:
    """Where one step's time went on the FFN path (read by the telemetry)."""

    traces: list[tuple[str, FFNReply]] = field(default_factory=list)  # (peer address, reply)
    # layers run in one native call with the shard's kernels (stack.py): (peer address, [n, 3]
    # float64 wall-clock stamps per layer: its start, the end of its attention, of its experts)
    inline: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    attention_seconds: list[float] = field(default_factory=list)  # work between pool calls
    max_in_flight: int = 0  # micro-batches with FFN work outstanding at once


class RoutedLoad:
    """Tokens routed to each expert in completed steps. The layers' ids are kept as sent and
    counted every few steps: one bincount for many layers and steps, not one per layer."""

    def __init__(self, num_layers: int, num_experts: int):
        self.load = torch.zeros(num_layers, max(num_experts, 1), dtype=torch.long)  # [L, E]
        # (layer, [T, k] ids) this step; (first layer, [n, T, k]) for layers run inline
        self._step: list[tuple[int, torch.Tensor]] = []
        self._done: list[tuple[int, torch.Tensor]] = []  # of completed steps, not yet added
        self._count_at = _COUNT_STEPS * max(1, num_layers)

    def add(self, layer: int, ids: torch.Tensor) -> None:
        """ids [T, k] int32 of `layer`, or [n, T, k] of layers layer .. layer + n - 1."""
        self._step.append((layer, ids))

    def drop_step(self) -> None:
        """A step that did not complete is not counted."""
        self._step.clear()

    def step_done(self, flush: bool) -> None:
        """The step completed: its ids are kept, and added to the load every _COUNT_STEPS
        steps or with `flush`."""
        self._done.extend(self._step)
        self._step.clear()
        if not self._done or not (flush or len(self._done) >= self._count_at):
            return
        # numpy on these few small arrays: a third of the time of the same torch ops
        e, load = self.load.shape[1], self.load.view(-1).numpy()
        flat = np.concatenate([_flat_ids(layer, ids, e) for layer, ids in self._done])
        load += np.bincount(flat, minlength=load.size)
        self._done.clear()


def _flat_ids(layer: int, ids: torch.Tensor, e: int) -> np.ndarray:
    """ids [T, k] of `layer`, or [n, T, k] of layers layer .. layer + n - 1, as flat indices
    into the [L, E] load; -1 (a dense layer inside a decode stack's run) counts as none."""
    a = to_host(ids).numpy()
    if a.ndim == 3:
        flat = (a + (layer + np.arange(a.shape[0]))[:, None, None] * e).ravel()
        return flat[a.ravel() >= 0] if bool((a < 0).any()) else flat
    return a.ravel() + layer * e
