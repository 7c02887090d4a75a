"""API-key check as ASGI middleware: deny by default, with an explicit public allowlist.

Every path not in the allowlist, including unknown ones, needs `Authorization: Bearer KEY`
(or `x-api-key: KEY`). The key is compared in constant time, so response timing says nothing
about how much of a guess was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from services.gateway.errors import error_body
from services.gateway.middleware import send_json

DEFAULT_PUBLIC = ("/health", "/ready", "/metrics")


class APIKeyMiddleware:
    """Rejects (401) any HTTP request outside `public` that does not carry the key."""

    def __init__(self, app, api_key: str, public: Iterable[str] = DEFAULT_PUBLIC):
        if not api_key:
            raise ValueError("an empty API key would let everyone in")
        self.app = app
        self._key = api_key.encode()
        self._public = frozenset(public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = error_body(
            "missing or incorrect API key: send 'Authorization: Bearer <key>'",
            "invalid_request_error",
            None,
            "invalid_api_key",
        )
        await send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])

    def _allowed(self, scope) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
                    break
            elif name == b"x-api-key":
                given = value.strip()
        # compare_digest takes time independent of where the first difference is.
        return hmac.compare_digest(given, self._key)
