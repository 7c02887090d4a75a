"""The expert workspace: MXFP4 experts converted online into the compute dtype, in one
fixed-size pool that every layer's experts share, least recently used first out.

The FFN server holds every expert of its shard in 4 bits and touches a few per layer and
token; converting all of them at load would hold 16 bits a weight instead of 4.25. The
workspace keeps the
converted (layer, expert) pairs that fit in `capacity_bytes`; a miss converts the expert's
two matrices (afd's native converter where it runs), possibly evicting others. An expert
larger than the whole pool is converted for its call and not kept.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from afd import metrics
from afd.ops import Linear


@dataclass
class WorkspaceStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    convert_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertWorkspace:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"workspace capacity must be >= 0, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.used = 0
        self.stats = WorkspaceStats()
        self._entries: OrderedDict[tuple[int, int], tuple[Linear, Linear, int]] = OrderedDict()
        self._lock = threading.Lock()  # micro-batches of one server can compute at once

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, key: tuple[int, int], convert: Callable[[], tuple[Linear, Linear]]
    ) -> tuple[Linear, Linear]:
        """The converted (w13, w2) of expert key = (layer, expert), converting on a miss."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                metrics.WORKSPACE_LOOKUPS.labels("hit").inc()
                return hit[0], hit[1]
            self.stats.misses += 1
            metrics.WORKSPACE_LOOKUPS.labels("miss").inc()
        t0 = time.perf_counter()
        w13, w2 = convert()
        size = _nbytes(w13) + _nbytes(w2)
        took = time.perf_counter() - t0
        metrics.WORKSPACE_CONVERSION.observe(took)
        with self._lock:
            self.stats.convert_seconds += took
            if size > self.capacity or key in self._entries:
                return w13, w2
            while self.used + size > self.capacity:
                _, (_, _, freed) = self._entries.popitem(last=False)
                self.used -= freed
                self.stats.evictions += 1
                metrics.WORKSPACE_EVICTIONS.inc()
            self._entries[key] = (w13, w2, size)
            self.used += size
            metrics.WORKSPACE_BYTES.set(self.used)
        return w13, w2


def _nbytes(lin: Linear) -> int:
    return lin.w.nbytes + (0 if lin.bias is None else lin.bias.nbytes)
