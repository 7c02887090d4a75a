"""The gateway's OpenAPI document, built from the pydantic request models.

The routes read raw bodies (so that a malformed one is a clear 400 of our own making), which
leaves FastAPI nothing to infer a schema from; this module states it instead, from the same
models that validate the requests. Served at /openapi.json; the HTTP fuzz tests generate their
requests from it.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic.json_schema import models_json_schema

from services.gateway.responses_schema import ResponsesRequest
from services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
# Every status the API answers with on purpose; anything else (a 500) is a bug.
_ERRORS = {
    "400": "invalid request (the message and param say what)",
    "401": "missing or wrong API key",
    "404": "no such route or model",
    "413": "body too large",
    "429": "overloaded: retry after the Retry-After header's seconds",
    "503": "no attention server can serve it now, or this gateway is draining",
    "504": "an attention server did not answer in time",
}
_POSTS = {
    "/v1/chat/completions": (ChatCompletionRequest, "Chat completion (JSON or SSE stream)"),
    "/v1/completions": (CompletionRequest, "Text completion (JSON or SSE stream)"),
    "/v1/responses": (ResponsesRequest, "OpenAI Responses API (JSON or SSE events)"),
    "/tokenize": (TokenizeRequest, "Token ids of a prompt or chat"),
    "/detokenize": (DetokenizeRequest, "Text of token ids"),
}
_GETS = {
    "/v1/models": "The served model",
    "/v1/models/{name}": "One model by name",
    "/v1/responses/{response_id}": "A stored response (Responses API)",
    "/v1/responses/{response_id}/input_items": "A stored response's input items, a page of them",
    "/health": "Liveness of this process",
    "/ready": "Ready while at least one attention server is; every server's state",
    "/ping": "SageMaker's readiness check: as /ready",
    "/metrics": "Prometheus metrics",
    "/version": "This server's version",
}


def _responses(ok: dict[str, Any]) -> dict[str, Any]:
    err = {"content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
    out = {"200": ok}
    out.update({code: {"description": why, **err} for code, why in _ERRORS.items()})
    return out


def _path_parameters(path: str) -> list[dict[str, Any]]:
    return [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"\{(\w+)\}", path)
    ]


def openapi(version: str = "0.1.0") -> dict[str, Any]:
    keys, top = models_json_schema(
        [(m, "validation") for m, _ in _POSTS.values()], ref_template=_REF
    )
    schemas = {**top.get("$defs", {}), "Error": _ERROR}
    paths: dict[str, Any] = {}
    for path, (model, summary) in _POSTS.items():
        body = {"content": {"application/json": {"schema": keys[(model, "validation")]}}}
        ok = {"description": "OK", "content": {"application/json": {}, "text/event-stream": {}}}
        paths[path] = {
            "post": {
                "summary": summary,
                "operationId": path.strip("/").replace("/", "_"),
                "requestBody": {"required": True, **body},
                "responses": _responses(ok),
            }
        }
    for path, summary in _GETS.items():
        op: dict[str, Any] = {
            "summary": summary,
            "operationId": "get_"
            + (re.sub(r"[{}]", "", path.strip("/").replace("/", "_")) or "root"),
            "responses": _responses({"description": "OK"}),
        }
        if "{" in path:
            op["parameters"] = _path_parameters(path)
        paths[path] = {"get": op}
    one = "/v1/responses/{response_id}"
    paths[one]["delete"] = {
        "summary": "Delete a stored response",
        "operationId": "delete_response",
        "parameters": _path_parameters(one),
        "responses": _responses({"description": "OK: deleted"}),
    }
    paths[one + "/cancel"] = {
        "post": {
            "summary": "Cancel a background response",
            "operationId": "cancel_response",
            "parameters": _path_parameters(one),
            "responses": _responses({"description": "OK: the response, cancelled"}),
        }
    }
    bodies = [keys[(m, "validation")] for m in (ChatCompletionRequest, CompletionRequest,
                                                  ResponsesRequest)]  # fmt: skip
    paths["/invocations"] = {
        "post": {
            "summary": "SageMaker's inference route: a chat, completion or Responses API body",
            "operationId": "invocations",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"anyOf": bodies}}},
            },
            "responses": _responses({"description": "OK, as the body's own endpoint"}),
        }
    }
    paths["/reset_prefix_cache"] = {
        "post": {
            "summary": "Forget every attention server's cached prefixes (vLLM's)",
            "operationId": "reset_prefix_cache",
            "responses": _responses({"description": "OK: the cached blocks forgotten"}),
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "afd gateway (OpenAI-compatible)", "version": version},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }
