"""`afd_expert_tokens_total{layer,expert}`: the tokens routed to each expert of each MoE layer,
read at scrape time from the attention engine's running count (no per-step metric calls)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, Metric

EXPERT_TOKENS = "afd_expert_tokens"


class ExpertLoadCollector:
    """A Prometheus collector over `source()`: rows of per-expert token counts by layer (a
    `[L, E]` tensor or nested lists), of which the layers in `moe_layers` are exported."""

    def __init__(self, source: Callable[[], object], moe_layers: list[int]):
        self._source = source
        self._layers = moe_layers

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            EXPERT_TOKENS,
            "Tokens routed to each expert of each MoE layer by this attention server (the load "
            "an elastic pool's placement balances)",
            labels=["layer", "expert"],
        )
        rows = self._source()
        rows = rows.tolist() if hasattr(rows, "tolist") else rows
        for layer in self._layers:
            for expert, n in enumerate(rows[layer]):
                family.add_metric([str(layer), str(expert)], float(n))
        yield family
