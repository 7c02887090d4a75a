"""Amazon SageMaker's inference-container contract, as vLLM serves it: `GET|POST /ping` is the
readiness check (public, as /ready is), and `POST /invocations` serves a body as the endpoint
its fields name would: a chat (`messages`), a completion (`prompt`) or a Responses API request
(`input`). Unlike vLLM's, /invocations asks for the API key as /v1 does: it is the same
inference."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ConfigDict

from services.gateway import handlers as h
from services.gateway.errors import invalid
from services.gateway.schema_base import Model

Handler = Callable[[Request], Awaitable[Response]]
ROUTES = ("/ping", "/invocations")


class _Invocation(Model):
    model_config = ConfigDict(extra="allow")  # any JSON object; its keys pick the endpoint


def add_routes(
    app: FastAPI, ready: Callable[[], Awaitable[Response]], by_field: dict[str, Handler]
) -> None:
    """`by_field`: the field whose presence picks each endpoint, first match wins."""

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await ready()

    @app.post("/invocations")
    async def invocations(request: Request):
        body = await h.parse(request, _Invocation)
        fields = set(body.model_extra or ())
        for field, handler in by_field.items():
            if field in fields:
                return await handler(request)  # it reads the same body again
        raise invalid(
            "an invocation is a chat (a body with messages), a completion (prompt) or a "
            "Responses API request (input)",
            code="unknown_invocation",
        )
