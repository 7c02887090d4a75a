"""A labelled histogram without prometheus_client's lock, for one writer thread."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class EngineHistogram:
    """A labelled histogram for the engine thread's per-message observations: observe() is a
    bisect and two additions, without prometheus_client's lock (which would cost more than the
    observation itself), because one thread writes it. A scrape from another thread may see an
    observation's bucket before its sum; the count is the buckets' total, so the two always
    agree."""

    _type = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str], buckets):
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._upper = tuple(float(b) for b in buckets) + (float("inf"),)
        self._series: dict[tuple[str, ...], _Series] = {}

    def labels(self, *values: str) -> _Series:
        key = tuple(str(v) for v in values)
        if len(key) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}")
        if key not in self._series:
            self._series[key] = _Series(self._upper)
        return self._series[key]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, series in list(self._series.items()):
            counts, total, cum = list(series.counts), series.total, 0.0
            buckets = []
            for le, n in zip(self._upper, counts, strict=True):
                cum += n
                buckets.append((floatToGoString(le), cum))
            family.add_metric(list(key), buckets, total)
        yield family


class _Series:
    __slots__ = ("_upper", "counts", "total")

    def __init__(self, upper: tuple[float, ...]):
        self._upper = upper
        self.counts = [0] * len(upper)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._upper, value)] += 1  # the first bucket with le >= value
        self.total += value
