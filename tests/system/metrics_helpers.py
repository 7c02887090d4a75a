"""Live-cluster helpers for the observability tests: start `afd serve` and learn where every
service's /metrics is, scrape and query Prometheus text."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from afd.plan.metrics_input import Histogram, Sample, histogram, parse_exposition


@dataclass
class Served:
    proc: subprocess.Popen
    url: str  # the API's /v1 URL
    log: Path
    metrics: dict[str, str] = field(default_factory=dict)  # child name -> /metrics URL

    def ffn_pool(self, attention: int = 0) -> list[str]:
        """The FFN addresses of attention-i, in shard order, from its start-up log line."""
        text = self.log.read_text()
        m = re.findall(rf"\[attention-{attention}\].*FFN pool: ([^)]*)\)", text)
        assert m, "no FFN pool line in the attention server's log"
        return [a.strip() for a in m[0].split(",")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(model: Path, *flags: str, timeout: float = 90.0) -> Served:
    """`afd serve` on a free port with small threads and KV cache, until it says it is ready."""
    log = model.parent / f"serve-{time.monotonic_ns()}.log"
    argv = [sys.executable, "-m", "afd_cli", "serve", "--model", str(model), "--port", "0"]
    proc = subprocess.Popen(
        [*argv, "--threads", "1", "--kv-cache-gb", "0.05", *flags],
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),  # noqa: SIM115 - the child owns it
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if m := re.search(r"metrics of (\S+): (\S+)", line):
            found[m.group(1)] = m.group(2)
        if m := re.search(r"afd is ready: (\S+)", line):
            return Served(proc, m.group(1), log, found)
    proc.kill()
    raise AssertionError("afd serve did not become ready:\n" + log.read_text()[-3000:])


def stream_text(
    url: str, body: dict, headers: dict | None = None, stamps: list[float] | None = None
) -> str:
    """One streaming completion (`url`: the API's /v1) and its text; fails on any error. The
    arrival time of each chunk goes to `stamps`, when given."""
    import httpx

    text = []
    with httpx.stream(
        "POST", f"{url}/completions", json={**body, "stream": True}, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
                if stamps is not None:
                    stamps.append(time.monotonic())
    return "".join(text)


def scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return parse_exposition(r.read().decode())


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of `name` over the label sets matching `labels` (0 when absent)."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.label(k) == v for k, v in labels.items())
    )


def hist(samples: list[Sample], name: str, **labels: str) -> Histogram:
    h = histogram(samples, name, **labels)
    assert h is not None, f"{name} {labels} is missing"
    inf = [c for le, c in h.buckets if le == float("inf")]
    assert inf and inf[0] == h.count, f"{name}: +Inf bucket != count"
    return h


def delta(after: Histogram, before: Histogram | None) -> Histogram:
    """The observations between two scrapes of one histogram."""
    if before is None:
        return after
    b = dict(before.buckets)
    return Histogram(
        count=after.count - before.count,
        total=after.total - before.total,
        buckets=tuple((le, c - b.get(le, 0.0)) for le, c in after.buckets),
    )


def bucket_width(h: Histogram, x: float) -> float:
    """The width of the histogram bucket holding x (the resolution of a quantile estimate)."""
    lower = 0.0
    for le, _ in h.buckets:
        if x <= le:
            return (le - lower) if le != float("inf") else float("inf")
        lower = le
    return float("inf")
