"""Measured per-layer times from a running afd cluster's Prometheus metrics, and what they imply.

The metric names below are the contract with the servers' `/metrics` (seconds, histograms):
  afd_attention_layer_seconds   attention server: one layer of one micro-batch, attention compute
                                (norm, projections, KV write, attention, o_proj, router)
  afd_ffn_compute_seconds       FFN server: compute of one layer call (one received message)
  afd_ffn_roundtrip_seconds     attention server, label `peer`: send of one layer's A2F message
                                to the reply's arrival from that FFN server
Point `--from-metrics` at every attention server's and FFN server's /metrics (or saved files);
samples of the same metric are summed across sources.
"""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from afd.metrics import (  # the names are defined once, with the metrics themselves
    ATTENTION_LAYER_SECONDS,
    FFN_COMPUTE_SECONDS,
    FFN_ROUNDTRIP_SECONDS,
    PEER_LABEL,
)
from afd.plan.errors import PlanError

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def _unescape(v: str) -> str:
    return v.replace("\\\\", "\0").replace('\\"', '"').replace("\\n", "\n").replace("\0", "\\")


def _labels(text: str, lineno: int) -> tuple[tuple[str, str], ...]:
    out, pos = [], 0
    while pos < len(text.strip()):
        m = _LABEL.match(text, pos)
        if not m:
            raise PlanError(f"metrics line {lineno}: malformed labels {{{text}}}")
        out.append((m.group(1), _unescape(m.group(2))))
        pos = m.end()
    return tuple(out)


def parse_exposition(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (version 0.0.4); comments are skipped."""
    samples = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise PlanError(f"metrics line {i} is not a Prometheus sample: {line[:80]!r}")
        try:
            value = float(m.group(4))  # accepts NaN, +Inf, -Inf as Prometheus writes them
        except ValueError:
            raise PlanError(f"metrics line {i}: value {m.group(4)!r} is not a number") from None
        samples.append(Sample(m.group(1), _labels(m.group(3) or "", i), value))
    return samples


@dataclass(frozen=True)
class Histogram:
    """A histogram summed over label sets: count, sum and cumulative buckets by upper bound."""

    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), ascending

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Linear interpolation inside the bucket holding rank q*count (as PromQL does)."""
        if not self.count or not self.buckets:
            return math.nan
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower
                width = cum - below
                return lower + (le - lower) * ((rank - below) / width if width else 1.0)
            lower, below = le, cum
        return lower


def histogram(samples: list[Sample], name: str, **match: str) -> Histogram | None:
    """The histogram `name`, summed over every label set matching `match` (None if absent)."""

    def picked(s: Sample, suffix: str) -> bool:
        return s.name == name + suffix and all(s.label(k) == v for k, v in match.items())

    counts = [s.value for s in samples if picked(s, "_count")]
    if not counts:
        return None
    buckets: dict[float, float] = {}
    for s in samples:
        if picked(s, "_bucket") and s.label("le") is not None:
            le = float(s.label("le") or "nan")
            buckets[le] = buckets.get(le, 0.0) + s.value
    return Histogram(
        count=sum(counts),
        total=sum(s.value for s in samples if picked(s, "_sum")),
        buckets=tuple(sorted(buckets.items())),
    )


def read_source(source: str, timeout_s: float = 5.0) -> str:
    """The text at an http(s):// or file:// URL, or at a local path."""
    if source.startswith(("http://", "https://", "file://")):
        try:
            with urllib.request.urlopen(source, timeout=timeout_s) as resp:  # noqa: S310
                return resp.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise PlanError(f"cannot read metrics from {source}: {e}") from None
    path = Path(source)
    if not path.is_file():
        raise PlanError(f"metrics source {source!r} is neither a URL nor an existing file")
    return path.read_text(errors="replace")


@dataclass(frozen=True)
class Measured:
    attention_layer_s: float  # mean, one layer of one micro-batch
    ffn_compute_s: float  # mean, one layer call on one FFN server
    roundtrip_s: float  # mean over all peers
    roundtrip_by_peer: tuple[tuple[str, float], ...]
    ffn_servers: int  # distinct peers seen
    samples: int  # attention-layer observations behind the means


def _required(samples: list[Sample], name: str) -> Histogram:
    h = histogram(samples, name)
    if h is None or not h.count:
        raise PlanError(
            f"metric {name!r} is missing or has no observations: point --from-metrics at every "
            "attention and FFN server's /metrics while the cluster is decoding"
        )
    return h


def measured_times(texts: list[str]) -> Measured:
    samples = [s for t in texts for s in parse_exposition(t)]
    att = _required(samples, ATTENTION_LAYER_SECONDS)
    ffn = _required(samples, FFN_COMPUTE_SECONDS)
    rt = _required(samples, FFN_ROUNDTRIP_SECONDS)
    peers = sorted(
        {
            p
            for s in samples
            if s.name.startswith(FFN_ROUNDTRIP_SECONDS)
            if (p := s.label(PEER_LABEL))
        }
    )
    by_peer = tuple(
        (p, h.mean) for p in peers if (h := histogram(samples, FFN_ROUNDTRIP_SECONDS, peer=p))
    )
    return Measured(att.mean, ffn.mean, rt.mean, by_peer, max(1, len(peers)), int(att.count))


@dataclass(frozen=True)
class Recommendation:
    ratio: float  # attention servers per FFN server that balances both sides
    attention_servers: int
    ffn_servers: int
    micro_batches: int
    network_s: float  # round trip minus FFN compute: wire + queueing
    predicted_ffn_utilisation: float  # at the recommended x:y, attention fully busy


def _nearest_pair(ratio: float, limit: int) -> tuple[int, int]:
    """The x:y with x, y <= limit closest to `ratio` (in log scale: 2:1 and 1:2 are equally far
    from 1:1), the fewest servers among equals (1:1, never 2:2)."""
    target = math.log(ratio)
    pairs = [(x, y) for x in range(1, limit + 1) for y in range(1, limit + 1)]
    return min(pairs, key=lambda p: (round(abs(math.log(p[0] / p[1]) - target), 9), sum(p)))


def recommend(m: Measured, max_servers: int = 8, max_micro_batches: int = 8) -> Recommendation:
    """Balance attention and FFN time, then pick enough micro-batches to hide the round trip.

    Every attention server's micro-batch-layer produces one call on each FFN server; splitting
    the experts over more FFN servers shortens each call in proportion (compute-bound FFN).
    An FFN server is then busy x * t_ffn * y0 / y per attention time t_attn, so x / y balances
    at t_attn / (t_ffn * y0), y0 being the FFN servers measured. A micro-batch's round trip
    must finish while attention runs the other S - 1: S >= 1 + round trip / t_attn.
    """
    if m.attention_layer_s <= 0 or m.ffn_compute_s <= 0:
        raise PlanError("measured attention and FFN times must be positive")
    ratio = m.attention_layer_s / (m.ffn_compute_s * m.ffn_servers)
    x, y = _nearest_pair(ratio, max_servers)
    ffn_call = m.ffn_compute_s * m.ffn_servers / y  # per call once the experts span y servers
    network = max(0.0, m.roundtrip_s - m.ffn_compute_s)
    s = math.ceil(1 + (network + ffn_call) / m.attention_layer_s)
    return Recommendation(
        ratio=ratio,
        attention_servers=x,
        ffn_servers=y,
        micro_batches=min(max_micro_batches, max(1, s)),
        network_s=network,
        predicted_ffn_utilisation=x * ffn_call / m.attention_layer_s,
    )
