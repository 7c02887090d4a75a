"""Where an attention server learns its elastic FFN pool: one place, read again and again.

- `file:PATH`: one FFN address per line (`#` starts a comment). `afd serve --elastic-ffn` writes
  it (atomically: a new file renamed over the old) when FFN servers are added or removed.
- `dns:SCHEME://NAME:PORT`: every address NAME resolves to, as SCHEME://IP:PORT. NAME is a
  Kubernetes headless Service in front of the FFN StatefulSet: it resolves to the IPs of the
  FFN pods that are ready, so scaling the StatefulSet is all it takes.

Both are pulled, every `interval_s` at most, between engine steps: nothing has to push to each
attention server, and one that restarts learns the current pool the same way. A source that
cannot be read keeps the last pool it read (a DNS hiccup must not empty the pool). DNS is
resolved on a thread of its own (a lookup can take seconds to fail; the engine thread only
takes the latest answer), the file read where it is asked for (a stat and a small read).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

from afd.errors import ConfigError

log = logging.getLogger("afd.attention")


class PoolSource:
    def __init__(self, spec: str, interval_s: float = 1.0):
        kind, _, rest = spec.partition(":")
        if kind not in ("file", "dns") or not rest:
            raise ConfigError(
                f"--ffn-pool must be file:PATH or dns:SCHEME://NAME:PORT, got {spec!r}"
            )
        self.spec = spec
        self.kind = kind
        self.interval_s = interval_s
        if kind == "dns":
            scheme, sep, hostport = rest.partition("://")
            host, _, port = hostport.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"--ffn-pool dns:SCHEME://NAME:PORT, got {spec!r}")
            self._dns = (scheme, host, int(port))
        else:
            self._path = Path(rest)
        self._checked = 0.0
        self._last: tuple[str, ...] | None = None
        self._resolved: tuple[str, ...] | None = None  # the resolver thread's latest answer
        self._resolver: threading.Thread | None = None

    def members(self, force: bool = False) -> tuple[str, ...] | None:
        """The pool's addresses (sorted) when it is time to look again (None otherwise); the
        last pool read when the source cannot be read now."""
        now = time.monotonic()
        if not force and now - self._checked < self.interval_s:
            return None
        self._checked = now
        if self.kind == "dns" and not force:
            self._start_resolver()
            if self._resolved is not None:
                self._last = self._resolved
            return self._last
        try:
            found = self._read()
        except (OSError, UnicodeDecodeError) as e:
            if self._last is None:
                raise ConfigError(f"cannot read the FFN pool {self.spec}: {e}") from e
            log.warning("cannot read the FFN pool %s (keeping the last one): %s", self.spec, e)
            return self._last
        self._last = found
        return found

    def _start_resolver(self) -> None:
        if self._resolver is None:
            self._resolver = threading.Thread(
                target=self._resolve_forever, name="ffn-pool-dns", daemon=True
            )
            self._resolver.start()

    def _resolve_forever(self) -> None:
        while True:
            try:
                self._resolved = self._read()
            except OSError as e:  # keep the last answer
                log.warning(
                    "cannot resolve the FFN pool %s (keeping the last one): %s", self.spec, e
                )
            time.sleep(self.interval_s)

    def _read(self) -> tuple[str, ...]:
        if self.kind == "file":
            text = self._path.read_text()
            lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
            return tuple(sorted({a for a in lines if a}))
        scheme, host, port = self._dns
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno == socket.EAI_NONAME:
                return ()  # no ready pod behind the Service (yet)
            raise OSError(str(e)) from e
        ips = {info[4][0] for info in infos}
        return tuple(sorted(f"{scheme}://{_host(ip)}:{port}" for ip in ips))


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def write_pool(path: Path, addresses: list[str]) -> None:
    """Replace the pool file at once (readers never see half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{a}\n" for a in addresses))
    os.replace(tmp, path)
