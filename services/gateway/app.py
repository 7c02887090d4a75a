"""The gateway: an OpenAI-compatible HTTP API in front of M attention servers.

`afd gateway --model DIR --attention HOST:PORT[,HOST:PORT] --port 8000 [--api-key KEY]`

It tokenizes, applies the chat template, validates, routes each choice to the least-loaded
attention server over the gRPC control plane and streams the tokens back. It holds no weights.
/ready is 200 while at least one attention server is ready (the body gives each server's
state); on SIGTERM the gateway drains (services/gateway/lifecycle.py) and exits 0.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from afd import metrics
from afd.config import ModelConfig, check
from afd.runtime import freeze_startup_heap
from afd.tokenizer import ModelTokenizer
from services.gateway import choices, model_defaults, prompts, responses_api, sagemaker
from services.gateway import handlers as h
from services.gateway.auth import APIKeyMiddleware
from services.gateway.balancer import Balancer
from services.gateway.client import AttentionClient
from services.gateway.config import GatewayConfig
from services.gateway.detok import TokenBytes
from services.gateway.errors import APIError, error_body, invalid, validation_message
from services.gateway.harmony import (
    HARMONY_REASONING,
    HARMONY_TOOLS,
)
from services.gateway.latency import publish_sla
from services.gateway.lifecycle import DrainingServer, DrainMiddleware
from services.gateway.middleware import BodyLimitMiddleware, CountingMiddleware, RequestIdMiddleware
from services.gateway.openapi import openapi
from services.gateway.request_log import RequestLog
from services.gateway.response_store import ResponseStore
from services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

log = logging.getLogger("afd.gateway")

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/responses/{response_id}",
    "/v1/responses/{response_id}/cancel",
    "/v1/responses/{response_id}/input_items",
    "/v1/models",
    "/version",
    "/health",
    "/ready",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/reset_prefix_cache",
    "/openapi.json",
    *sagemaker.ROUTES,
)


def build_state(cfg: GatewayConfig) -> h.GatewayState:
    tokenizer = ModelTokenizer(cfg.model_dir)
    if cfg.chat_template:
        tokenizer.use_chat_template(model_defaults.chat_template(cfg.chat_template))
    defaults = model_defaults.sampling_defaults(cfg.generation_config, cfg.model_dir)
    if defaults:
        log.info("sampling defaults from the model's generation config: %s", defaults)
    clients = [
        AttentionClient(a, cfg.rpc_timeout_s, cfg.generate_timeout_s, cfg.security)
        for a in cfg.attention
    ]
    model = ModelConfig.from_hf(cfg.model_dir)
    check_parsers(cfg, model.chat_format)
    return h.GatewayState(
        tokenizer=tokenizer,
        token_bytes=TokenBytes(tokenizer),
        balancer=Balancer(clients, routing=cfg.routing),
        model_name=cfg.model_name,
        vocab_size=model.vocab_size,
        notice=cfg.notice,
        chat_format=model.chat_format,
        sampling_defaults=defaults,
    )


def check_parsers(cfg: GatewayConfig, chat_format: str) -> None:
    """The parsers fit the model: a harmony model (gpt-oss) is read by harmony.py, whose
    names in vLLM are the tool-call parser `openai` and the reasoning parser
    `openai_gptoss`; a text model by the others."""
    harmony = chat_format == "harmony"
    tools, think = cfg.tool_call_parser, cfg.reasoning_parser
    check(
        not tools or (tools == HARMONY_TOOLS) == harmony,
        f"--tool-call-parser {tools} does not read this model's answers; "
        + (f"gpt-oss's harmony needs {HARMONY_TOOLS}" if harmony else "it is for gpt-oss"),
    )
    check(
        not think or (think == HARMONY_REASONING) == harmony,
        f"--reasoning-parser {think} does not read this model's answers; "
        + (f"gpt-oss's harmony needs {HARMONY_REASONING} (or none: it is read anyway)"
           if harmony else "it is for gpt-oss"),
    )  # fmt: skip


def create_app(state: h.GatewayState, cfg: GatewayConfig):
    """The ASGI application: FastAPI routes wrapped in CORS, request-id, counting, draining,
    auth and body-limit middleware (outermost first)."""

    metrics.register("gateway")
    publish_sla(cfg.sla)
    state = replace(
        state,
        sla=cfg.sla,
        template_timeout_s=cfg.template_timeout_s,
        max_tokens_limit=cfg.max_tokens_limit,
        startup_wait_s=cfg.startup_wait_s,
        tool_parser=cfg.tool_call_parser if cfg.enable_auto_tool_choice else "",
        reasoning_parser=cfg.reasoning_parser,
        max_logprobs=cfg.max_logprobs,
        chat_template_defaults=dict(cfg.default_chat_template_kwargs or {}),
        responses=ResponseStore(cfg.responses_store_mb << 20),
        model_aliases=cfg.model_aliases,
        force_include_usage=cfg.force_include_usage,
        tokens_as_token_ids=cfg.tokens_as_token_ids,
        request_log=(
            RequestLog(state.tokenizer.decode, cfg.log_outputs, cfg.max_log_len)
            if cfg.log_requests
            else None
        ),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await state.balancer.start()
        yield
        await state.balancer.close()

    app = FastAPI(title="afd", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    _add_error_handlers(app)
    by_field = _add_openai_routes(app, state)
    by_field["input"] = responses_api.add_routes(app, state)
    sagemaker.add_routes(app, lambda: _readiness(state), by_field)
    _add_service_routes(app, state)
    asgi = BodyLimitMiddleware(app, cfg.max_body_bytes)
    if cfg.api_key:
        public = ["/health", "/ready", "/ping"] + (["/metrics"] if cfg.public_metrics else [])
        asgi = APIKeyMiddleware(asgi, cfg.api_key, public)
    asgi = DrainMiddleware(asgi, state.lifecycle)
    asgi = CountingMiddleware(
        asgi, lambda e, s: metrics.GATEWAY_REQUESTS.labels(e, str(s)).inc(), ENDPOINTS
    )
    # outermost: a browser's preflight carries no API key, and every answer needs its headers
    return CORSMiddleware(
        RequestIdMiddleware(asgi),
        allow_origins=cfg.allowed_origins,
        allow_methods=cfg.allowed_methods,
        allow_headers=cfg.allowed_headers,
        allow_credentials=cfg.allow_credentials,
    )


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_req: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_req: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, e: Exception):
        log.exception("unexpected error")
        return JSONResponse(error_body(f"internal error: {e}", "internal_error"), 500)


def _add_openai_routes(app: FastAPI, state: h.GatewayState) -> dict[str, sagemaker.Handler]:
    """The OpenAI routes; returns the inference handlers by the body field that picks each
    (SageMaker's /invocations)."""

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await h.parse(request, ChatCompletionRequest)
        h.check_model(state, req.model)
        prompts.check_tools(state, req)
        prompt = [(await prompts.chat_prompt(state, req), "")]
        specs = await choices.plan(state, req, prompt, request.state.request_id)
        return await h.respond(state, request, req, specs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await h.parse(request, CompletionRequest)
        h.check_model(state, req.model)
        texts = prompts.completion_prompts(state, req)
        specs = await choices.plan(state, req, texts, request.state.request_id)
        return await h.respond(state, request, req, specs)

    @app.get("/v1/models")
    async def models():
        card = await _model_card(state)
        names = (state.model_name, *state.model_aliases)  # one card per name, as vLLM's
        return {"object": "list", "data": [{**card, "id": n} for n in names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        h.check_model(state, name)
        return {**await _model_card(state), "id": name}

    return {"messages": chat, "prompt": completions}


async def _model_card(state: h.GatewayState) -> dict:
    """The model as /v1/models lists it; a 503 'starting' until an attention server is ready,
    so that a client polling for 200 never then meets a 503 for "not ready"."""
    await state.balancer.wait_started(0.0)
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "afd"}
    try:
        card["max_model_len"] = await state.balancer.max_model_len()
    except APIError:
        pass  # every server went away since it started; the card is still true
    if state.notice:
        card["description"] = state.notice
    return card


async def _readiness(state: h.GatewayState) -> JSONResponse:
    """Ready while at least one attention server is ready and this gateway is not draining;
    the body gives every server's state (ready, not ready, draining, down)."""
    ok, reasons = await state.balancer.readiness()
    if state.lifecycle.draining:
        ok, reasons = False, ["this gateway is draining (shutting down)", *reasons]
    status = "draining" if state.lifecycle.draining else "ready" if ok else "not ready"
    body = {"status": status, "reasons": reasons, "servers": state.balancer.servers()}
    return JSONResponse(body, status_code=200 if ok else 503)


def _add_service_routes(app: FastAPI, state: h.GatewayState) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}  # liveness of this process only; /ready covers the cluster

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's: every attention server forgets its cached prefixes (a cold-cache
        benchmark's start); requests running keep their blocks."""
        counts = await asyncio.gather(
            *(c.reset_prefix_cache() for c in state.balancer.clients), return_exceptions=True
        )
        failed = next((e for e in counts if isinstance(e, BaseException)), None)
        if failed is not None:
            raise failed
        return {"forgotten_blocks": sum(counts)}

    @app.get("/version")
    async def version():
        return {"version": _version()}  # vLLM's: the server's own version

    @app.get("/ready")
    async def ready():
        return await _readiness(state)

    spec = openapi()

    @app.get("/openapi.json")
    async def openapi_json():
        return spec

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await h.parse(request, TokenizeRequest)
        if req.messages is not None:
            try:  # the chat's own rules (two tools of one name, say) are the client's 400
                chat = ChatCompletionRequest(
                    messages=req.messages,
                    add_generation_prompt=req.add_generation_prompt,
                    tools=req.tools,
                    chat_template_kwargs=req.chat_template_kwargs,
                    continue_final_message=req.continue_final_message,
                    add_special_tokens=bool(req.add_special_tokens),
                )
            except ValidationError as e:
                msg, param = validation_message(e.errors(include_url=False))
                raise invalid(msg, param=param) from None
            ids = await prompts.chat_prompt(state, chat)
        else:
            special = req.add_special_tokens is not False
            ids = state.tokenizer.encode(req.prompt or "", special)
        out: dict[str, Any] = {"tokens": ids, "count": len(ids)}
        if req.return_token_strs:
            out["token_strs"] = state.tokenizer.token_strs(ids)
        try:
            out["max_model_len"] = await state.balancer.max_model_len()
        except APIError:
            pass
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await h.parse(request, DetokenizeRequest)
        prompts.check_token_ids(state, req.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.get("/")
    async def root():
        return PlainTextResponse("afd gateway: OpenAI-compatible API under /v1\n")


# ------------------------------------------------------------------ command line


def serve(cfg: GatewayConfig) -> int:
    import uvicorn

    state = build_state(cfg)
    app = create_app(state, cfg)
    log.info("gateway on http://%s:%d/v1 -> attention %s", cfg.host, cfg.port, cfg.attention)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=logging.getLevelName(logging.getLogger().level).lower(),
        access_log=False,
        # The drain has let requests in flight finish already; what is left is cut off.
        timeout_graceful_shutdown=1,
        # grpc.aio supports the standard loop only; the HTTP parser is httptools when it is
        # installed (uvicorn's "auto"), several times cheaper per request than h11.
        loop="asyncio",
    )
    freeze_startup_heap()
    DrainingServer(config, state.lifecycle, cfg.drain_timeout_s).run()
    return 0


def _version() -> str:
    try:
        return importlib.metadata.version("afd")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"
