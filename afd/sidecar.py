"""The HTTP side port of the attention and FFN servers: /metrics, /health, /ready.

Their data and control planes speak ZeroMQ and gRPC; Prometheus and Kubernetes probes speak
HTTP. This small server answers them from a thread of the service itself.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from afd.config import check

log = logging.getLogger("afd.sidecar")

ReadyFn = Callable[[], tuple[bool, str]]


@dataclass(frozen=True)
class SidePortConfig:
    metrics_host: str = "127.0.0.1"  # interface of the HTTP side port
    metrics_port: int = 0  # HTTP side port serving /metrics, /health, /ready; 0: off

    def __post_init__(self) -> None:
        check(0 <= self.metrics_port < 65536, f"metrics port {self.metrics_port} is not a port")


class _Handler(BaseHTTPRequestHandler):
    ready_fn: ReadyFn

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif path == "/health":
            self._send(200, b'{"status":"ok"}\n', "application/json")
        elif path == "/ready":
            try:
                ready, reason = self.ready_fn()
            except Exception as e:  # a probe must answer, never hang or crash the server
                log.warning("readiness check failed: %s: %s", type(e).__name__, e)
                ready, reason = False, "readiness check failed (see this service's log)"
            doc = {"ready": True} if ready else {"ready": False, "reason": reason}
            body = (json.dumps(doc) + "\n").encode()
            self._send(200 if ready else 503, body, "application/json")
        else:
            self._send(404, b'{"error":"not found"}\n', "application/json")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args) -> None:  # quiet: probes arrive every few seconds
        log.debug(fmt, *args)


class Sidecar:
    def __init__(self, host: str, port: int, ready_fn: ReadyFn):
        handler = type("Handler", (_Handler,), {"ready_fn": staticmethod(ready_fn)})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="sidecar", daemon=True
        )
        self._thread.start()
        log.info("metrics and probes on http://%s:%d (/metrics, /health, /ready)", host, self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start(cfg: SidePortConfig, ready_fn: ReadyFn) -> Sidecar | None:
    """None when the side port is off (port 0)."""
    return Sidecar(cfg.metrics_host, cfg.metrics_port, ready_fn) if cfg.metrics_port else None
