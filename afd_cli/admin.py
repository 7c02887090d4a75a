"""`afd serve --admin-port`: the authenticated admin endpoint of a local cluster.

    GET    /admin/ffn          the FFN pool's members
    POST   /admin/ffn          start one more FFN server; answers once it is in the pool (201)
    DELETE /admin/ffn/NAME     take FFN server NAME out of the pool and stop it (200)

Every call needs `Authorization: Bearer <the API key>` (401 otherwise): these calls start and
stop processes. It listens on 127.0.0.1 only. Errors are OpenAI-style bodies naming the cause.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from afd.errors import AfdError
from afd_cli.elastic import ElasticFFN, PoolError

log = logging.getLogger("afd.serve")


def _error(status: int, message: str, kind: str) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": kind, "code": status}}


class _Handler(BaseHTTPRequestHandler):
    pool: ElasticFFN
    key: str

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        log.info("admin: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(lambda: (200, {"members": [m.as_dict() for m in self.pool.members()]}))

    def do_POST(self) -> None:  # noqa: N802
        self._answer(lambda: (201, {"added": self.pool.add().as_dict()}))

    def do_DELETE(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        name = path[len("/admin/ffn/") :] if path.startswith("/admin/ffn/") else ""
        if not name:
            self._send(*_error(404, f"no such endpoint: DELETE {path}", "not_found_error"))
            return
        self._answer(lambda: (200, {"removed": self.pool.remove(name).as_dict()}), exact=False)

    def _answer(self, act, exact: bool = True) -> None:
        path = self.path.split("?", 1)[0]
        if exact and path != "/admin/ffn":
            self._send(*_error(404, f"no such endpoint: {self.command} {path}", "not_found_error"))
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
            self._send(*_error(401, "the admin endpoint needs the API key", "authentication_error"))
            return
        try:
            self._send(*act())
        except PoolError as e:
            self._send(*_error(e.status, str(e), "invalid_request_error"))
        except AfdError as e:
            self._send(*_error(500, str(e), "server_error"))

    def _send(self, status: int, doc: dict) -> None:
        body = (json.dumps(doc) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve_admin(pool: ElasticFFN, port: int, key: str) -> ThreadingHTTPServer:
    """Start the endpoint on 127.0.0.1:port in a daemon thread; `.shutdown()` stops it."""
    handler = type("AdminHandler", (_Handler,), {"pool": pool, "key": key})
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError as e:
        raise AfdError(f"cannot serve the admin endpoint on 127.0.0.1:{port}: {e.strerror}") from e
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="admin", daemon=True).start()
    return server
