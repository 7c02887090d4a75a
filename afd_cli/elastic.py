"""`afd serve --elastic-ffn`: FFN servers added to and removed from the running cluster.

The attention servers read the pool from a file (`--ffn-pool file:...`, written atomically
here). Adding: a new FFN server (every expert) is started, and once its /ready answers it is
written into the pool; each attention server probes it and gives it work at its next step.
Removing: it is taken out of the pool first; after the attention servers have read the pool
again (twice their `--ffn-pool-interval`, and a step) it is sent SIGTERM and drains (a
message that still reaches it is answered "draining" and computed by another member), so no
request fails. The supervisor never sees a removed server, so it is not restarted.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from afd.errors import AfdError
from afd_cli.cluster import Child, Cluster
from afd_cli.procs import stop_child
from services.attention.pool_source import write_pool

log = logging.getLogger("afd.serve")


class PoolError(AfdError):
    """A change the pool cannot make (an unknown server, the last one); `status` for HTTP."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Member:
    name: str
    address: str
    metrics_url: str

    def as_dict(self) -> dict:
        return {"name": self.name, "address": self.address, "metrics": self.metrics_url}


class ElasticFFN:
    def __init__(self, cluster: Cluster, interval_s: float = 1.0, settle_s: float = 1.0):
        if cluster.pool_file is None:
            raise AfdError("the cluster has no elastic FFN pool (--elastic-ffn)")
        self.cluster = cluster
        # how long the attention servers take to stop sending to a removed member: two reads
        # of the pool, and the step in flight
        self.settle_s = 2 * interval_s + settle_s
        self._next = itertools.count(cluster.cfg.ffn)
        self._changing = threading.Lock()  # one change at a time
        # A child is asked to die with the thread that started it (PR_SET_PDEATHSIG follows
        # the thread, not the process): start them from one thread that lives as long as we
        # do, not from the admin endpoint's short-lived request threads.
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="ffn-launcher")

    def members(self) -> list[Member]:
        with self.cluster.lock:
            return [
                Member(c.name, c.address, c.metrics_url)
                for c in self.cluster.children
                if c.name.startswith("ffn-")
            ]

    def add(self, timeout_s: float = 300.0) -> Member:
        """Start one more FFN server; it joins the pool once it is ready."""
        with self._changing:
            i = next(self._next)
            child = self.cluster.ffn_child(i, 1, self.cluster.ffn_address(i))
            self._launcher.submit(self.cluster.launch, child).result()
            try:
                _wait_ready(child, timeout_s)
            except BaseException:
                stop_child(child, 10.0)
                raise
            with self.cluster.lock:
                self.cluster.children.append(child)
            self._write()
            log.info("FFN pool: added %s (%s)", child.name, child.address)
            return Member(child.name, child.address, child.metrics_url)

    def remove(self, name: str) -> Member:
        """Take an FFN server out of the pool, then stop it once nothing is sent to it."""
        with self._changing:
            members = self.members()
            target = next((m for m in members if m.name == name), None)
            if target is None:
                raise PoolError(f"no FFN server named {name!r} (see GET /admin/ffn)", 404)
            if len(members) == 1:
                raise PoolError(f"{name} is the last FFN server: the pool would be empty", 409)
            with self.cluster.lock:
                child = next(c for c in self.cluster.children if c.name == name)
                self.cluster.children.remove(child)  # the supervisor lets it go
            self._write()
            time.sleep(self.settle_s)
            stop_child(child, self.cluster.cfg.stop_timeout_s)
            log.info("FFN pool: removed %s (%s)", name, target.address)
            return target

    def _write(self) -> None:
        assert self.cluster.pool_file is not None
        write_pool(self.cluster.pool_file, [m.address for m in self.members()])


def _wait_ready(child: Child, timeout_s: float) -> None:
    url = child.metrics_url.rsplit("/", 1)[0] + "/ready"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc is not None and child.proc.poll() is not None:
            raise AfdError(f"{child.name} exited with code {child.proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise AfdError(f"{child.name} was not ready within {timeout_s:.0f} s")
