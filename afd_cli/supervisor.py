"""`afd serve` as a process manager: a child that dies once the cluster is up is started again
(same command line, so the same ports: its peers reconnect on their own), after a backoff that
doubles with each recent restart; a child that dies more than `max_restarts` times within
`window_s` is crash-looping, and the cluster stops, saying so. Each death and restart is logged
with its cause (exit code or signal) and when the restart comes."""

from __future__ import annotations

import logging
import signal
import time
from collections import deque

from afd_cli.cluster import Child, Cluster

log = logging.getLogger("afd.serve")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


def cause(code: int) -> str:
    """How a process ended, in words: `exit code 2` or `killed by SIGKILL`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    def __init__(self, cluster: Cluster, max_restarts: int, window_s: float):
        self.cluster = cluster
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._restarts: dict[str, deque[float]] = {}  # child -> monotonic times of restarts
        self._due: dict[str, float] = {}  # child -> monotonic time its restart is due
        self.restarted: dict[str, int] = {}  # child -> restarts so far (for logs and tests)

    def check(self) -> str | None:
        """Restart what died and is due; returns why the cluster must stop (a crash loop),
        else None. Call it every fraction of a second."""
        now = time.monotonic()
        with self.cluster.lock:  # the admin endpoint may add or remove FFN servers
            children = list(self.cluster.children)
        for child in children:
            if child.name in self._due:
                if now >= self._due[child.name]:
                    del self._due[child.name]
                    self._restart(child, now)
                continue
            code = child.proc.poll() if child.proc else None
            if code is None:
                continue
            recent = self._recent(child.name, now)
            if len(recent) >= self.max_restarts:
                return (
                    f"{child.name} ended ({cause(code)}) after {len(recent)} restarts in the last "
                    f"{self.window_s:.0f} s: it is crash-looping (--max-restarts "
                    f"{self.max_restarts} per --restart-window {self.window_s:.0f} s); stopping "
                    "the cluster (its log lines above say why it ended)"
                )
            delay = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** len(recent))
            log.warning(
                "%s ended (%s); restarting it in %.1f s (restart %d of at most %d in %.0f s)",
                child.name,
                cause(code),
                delay,
                len(recent) + 1,
                self.max_restarts,
                self.window_s,
            )
            self._due[child.name] = now + delay
        return None

    def _recent(self, name: str, now: float) -> deque[float]:
        times = self._restarts.setdefault(name, deque())
        while times and now - times[0] > self.window_s:
            times.popleft()
        return times

    def _restart(self, child: Child, now: float) -> None:
        self._restarts.setdefault(child.name, deque()).append(now)
        self.restarted[child.name] = self.restarted.get(child.name, 0) + 1
        self.cluster.launch(child)
