"""The gateway: an OpenAI-compatible HTTP API in front of M attention servers.

`afd gateway --model DIR --attention HOST:PORT[,HOST:PORT] --port 8000 [--api-key KEY]`

It tokenizes, applies the chat template, validates, routes each choice to the least-loaded
attention server over the gRPC control plane and streams the tokens back. It holds no weights.
/ready is 200 while at least one attention server is ready (the body gives each server's
state); on SIGTERM the gateway drains (services/gateway/lifecycle.py) and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from afd import metrics
from afd.config import ModelConfig
from afd.errors import AfdError
from afd.security import Security
from afd.tokenizer import ModelTokenizer
from services.gateway import handlers as h
from services.gateway.auth import APIKeyMiddleware
from services.gateway.client import AttentionClient
from services.gateway.detok import TokenBytes
from services.gateway.errors import APIError, error_body
from services.gateway.latency import SLA, publish_sla
from services.gateway.lifecycle import DrainingServer, DrainMiddleware
from services.gateway.middleware import BodyLimitMiddleware, CountingMiddleware, RequestIdMiddleware
from services.gateway.openapi import openapi
from services.gateway.router import Router
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
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/openapi.json",
)


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: str
    attention: tuple[str, ...]  # control-plane addresses, host:port
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # empty: no authentication
    public_metrics: bool = True  # /metrics without the key
    max_body_bytes: int = 4 << 20
    generate_timeout_s: float = 600.0  # deadline of one Generate stream
    rpc_timeout_s: float = 2.0  # deadline of Health / Stats / Abort
    notice: str = ""  # shown on the model card
    sla: SLA = SLA()  # targets of the SLA-attainment (goodput) counters
    drain_timeout_s: float = 30.0  # on SIGTERM: how long requests in flight may still run
    template_timeout_s: float = 2.0  # chat-template rendering, at most
    max_tokens_limit: int = 0  # max_tokens, at most (0: whatever the context leaves)
    security: Security = field(default_factory=Security)  # TLS to the attention servers


def build_state(cfg: GatewayConfig) -> h.GatewayState:
    tokenizer = ModelTokenizer(cfg.model_dir)
    clients = [
        AttentionClient(a, cfg.rpc_timeout_s, cfg.generate_timeout_s, cfg.security)
        for a in cfg.attention
    ]
    return h.GatewayState(
        tokenizer=tokenizer,
        token_bytes=TokenBytes(tokenizer),
        router=Router(clients),
        model_name=cfg.model_name,
        vocab_size=ModelConfig.from_hf(cfg.model_dir).vocab_size,
        notice=cfg.notice,
    )


def create_app(state: h.GatewayState, cfg: GatewayConfig):
    """The ASGI application: FastAPI routes wrapped in request-id, counting, auth and
    body-limit middleware (outermost first)."""

    metrics.register("gateway")
    publish_sla(cfg.sla)
    state = replace(
        state,
        sla=cfg.sla,
        template_timeout_s=cfg.template_timeout_s,
        max_tokens_limit=cfg.max_tokens_limit,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await state.router.start()
        yield
        await state.router.close()

    app = FastAPI(title="afd", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    _add_error_handlers(app)
    _add_openai_routes(app, state)
    _add_service_routes(app, state)
    asgi = BodyLimitMiddleware(app, cfg.max_body_bytes)
    if cfg.api_key:
        public = ["/health", "/ready"] + (["/metrics"] if cfg.public_metrics else [])
        asgi = APIKeyMiddleware(asgi, cfg.api_key, public)
    asgi = DrainMiddleware(asgi, state.lifecycle)
    asgi = CountingMiddleware(
        asgi, lambda e, s: metrics.GATEWAY_REQUESTS.labels(e, str(s)).inc(), ENDPOINTS
    )
    return RequestIdMiddleware(asgi)


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


def _add_openai_routes(app: FastAPI, state: h.GatewayState) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await h.parse(request, ChatCompletionRequest)
        h.check_model(state, req.model)
        prompt = [(await h.chat_prompt(state, req), "")]
        specs = await h.plan(state, req, prompt, request.state.request_id)
        return await h.respond(state, request, req, specs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await h.parse(request, CompletionRequest)
        h.check_model(state, req.model)
        prompts = h.completion_prompts(state, req)
        specs = await h.plan(state, req, prompts, request.state.request_id)
        return await h.respond(state, request, req, specs)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [await _model_card(state)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        h.check_model(state, name)
        return await _model_card(state)


async def _model_card(state: h.GatewayState) -> dict:
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "afd"}
    try:
        card["max_model_len"] = await state.router.max_model_len()
    except APIError:
        pass  # not known until an attention server answers; the card is still useful
    if state.notice:
        card["description"] = state.notice
    return card


def _add_service_routes(app: FastAPI, state: h.GatewayState) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}  # liveness of this process only; /ready covers the cluster

    @app.get("/ready")
    async def ready():
        """Ready while at least one attention server is ready and this gateway is not
        draining; the body gives every server's state (ready, not ready, draining, down)."""
        ok, reasons = await state.router.readiness()
        if state.lifecycle.draining:
            ok, reasons = False, ["this gateway is draining (shutting down)", *reasons]
        status = "draining" if state.lifecycle.draining else "ready" if ok else "not ready"
        body = {"status": status, "reasons": reasons, "servers": state.router.servers()}
        return JSONResponse(body, status_code=200 if ok else 503)

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
            chat = ChatCompletionRequest(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt
            )
            ids = await h.chat_prompt(state, chat)
        else:
            ids = state.tokenizer.encode(req.prompt or "")
        out = {"tokens": ids, "count": len(ids)}
        try:
            out["max_model_len"] = await state.router.max_model_len()
        except APIError:
            pass
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await h.parse(request, DetokenizeRequest)
        h.check_token_ids(state, req.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.get("/")
    async def root():
        return PlainTextResponse("afd gateway: OpenAI-compatible API under /v1\n")


# ------------------------------------------------------------------ command line


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `afd gateway` on an argparse subparsers object; sets func=run."""
    p = subparsers.add_parser("gateway", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--model", help="model directory for the tokenizer (default: the demo model)")
    p.add_argument(
        "--attention",
        required=True,
        help="attention servers' control-plane addresses, HOST:PORT, comma-separated",
    )
    p.add_argument("--served-model-name", help="the model's name in the API (default: dir name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("AFD_API_KEY", ""),
        help="require this key (Authorization: Bearer); default: $AFD_API_KEY, which keeps "
        "the key out of the process list",
    )
    p.add_argument(
        "--private-metrics", action="store_true", help="require the API key for /metrics too"
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline per request, s")
    p.add_argument(
        "--template-timeout",
        type=float,
        default=2.0,
        help="chat-template rendering time limit, s (a slower render is a 400)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=0,
        help="largest max_tokens accepted (0: whatever the context leaves after the prompt)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: answer new requests 503 and let those in flight finish for up to "
        "this many seconds, then exit 0",
    )
    g = p.add_argument_group("TLS to the attention servers (flags fall back to AFD_TLS_* env vars)")
    g.add_argument(
        "--tls-ca", default="", help="CA bundle that signed the attention servers' certs"
    )
    g.add_argument("--tls-cert", default="", help="client certificate chain, for mutual TLS (PEM)")
    g.add_argument("--tls-key", default="", help="client private key, for mutual TLS (PEM)")
    add_sla_args(p)
    p.set_defaults(func=run)
    return p


def add_sla_args(p: argparse.ArgumentParser) -> None:
    """--sla-ttft / --sla-tpot (also on `afd serve`, which passes them to its gateway)."""
    p.add_argument(
        "--sla-ttft", type=float, default=0.0, help="TTFT target in seconds (0: none) for goodput"
    )
    p.add_argument(
        "--sla-tpot",
        type=float,
        default=SLA().tpot_s,
        help="time-per-output-token target in seconds (0: none) for goodput; default 0.05",
    )


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if args.sla_ttft < 0 or args.sla_tpot < 0:
        raise AfdError("--sla-ttft and --sla-tpot must be >= 0 (0: no target)")
    if args.drain_timeout < 0 or args.template_timeout <= 0 or args.max_tokens_limit < 0:
        raise AfdError(
            "--drain-timeout and --max-tokens-limit must be >= 0, --template-timeout > 0"
        )
    notice = ""
    if args.model:
        model_dir, name = args.model, Path(args.model).name
    else:
        from afd.demo import DEMO_NOTICE, demo_model_dir

        model_dir, name, notice = str(demo_model_dir()), "afd-demo-step3", DEMO_NOTICE
    return GatewayConfig(
        model_dir=model_dir,
        attention=tuple(a.strip() for a in args.attention.split(",") if a.strip()),
        model_name=args.served_model_name or name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        public_metrics=not args.private_metrics,
        max_body_bytes=args.max_body_bytes,
        generate_timeout_s=args.request_timeout,
        notice=notice,
        sla=SLA(ttft_s=args.sla_ttft, tpot_s=args.sla_tpot),
        drain_timeout_s=args.drain_timeout,
        template_timeout_s=args.template_timeout,
        max_tokens_limit=args.max_tokens_limit,
        security=Security(
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca
        ).with_env(),
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    cfg = config_from_args(args)
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
    DrainingServer(config, state.lifecycle, cfg.drain_timeout_s).run()
    return 0
