"""Plain ASGI middleware (cheaper than Starlette's BaseHTTPMiddleware and safe for streams):
request ids and arrival stamps, the body-size limit, and per-endpoint request counting."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterable

from services.gateway.errors import error_body

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


async def send_json(send, status: int, body: dict, headers: Iterable[tuple[bytes, bytes]] = ()):
    raw = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": raw})


class RequestIdMiddleware:
    """Honours a client's X-Request-Id (when it is a sane token) or makes one; either way the
    response carries it and handlers find it in `request.state.request_id`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = (_header(scope, b"x-request-id") or b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state["t_arrival"] = time.perf_counter()  # the start of the client-seen latencies

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Answers 413 to a body over `limit` bytes, whether or not it announced its length, before
    any handler sees it. The body is read here once and handed on whole."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_large(send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large(send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for http.disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        msg = f"request body is larger than the limit of {self.limit} bytes"
        await send_json(send, 413, error_body(msg, "invalid_request_error", None, "body_too_large"))


class CountingMiddleware:
    """Counts answered requests by endpoint and status; a path with an id is counted under its
    template ("/v1/responses/{response_id}"), unknown paths share one label, so a scanner
    cannot blow up the metric's cardinality."""

    def __init__(self, app, count: Callable[[str, int], None], endpoints: Iterable[str]):
        self.app = app
        self._count = count
        self._endpoints = frozenset(e for e in endpoints if "{" not in e)
        self._templates = [
            (re.compile(re.sub(r"\{[^/]+\}", "[^/]+", e) + "$"), e) for e in endpoints if "{" in e
        ]

    def _label(self, path: str) -> str:
        if path in self._endpoints:
            return path
        return next((e for pattern, e in self._templates if pattern.match(path)), "other")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = self._label(scope["path"])

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self._count(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
