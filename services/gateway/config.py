"""The gateway's configuration (`afd gateway`'s flags fill it: services/gateway/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from afd.config import check
from afd.security import Security
from services.gateway.harmony import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES
from services.gateway.latency import SLA
from services.gateway.routing import RoutingConfig


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: str  # for the tokenizer and chat template
    attention: tuple[str, ...]  # control-plane addresses, host:port
    model_name: str  # the name responses carry
    model_aliases: tuple[str, ...] = ()  # more names requests may use (vLLM's further names)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # empty: no authentication
    public_metrics: bool = True  # /metrics without the key
    max_body_bytes: int = 4 << 20
    generate_timeout_s: float = 600.0  # deadline of one request on the control plane
    rpc_timeout_s: float = 2.0  # deadline of Health / Stats / Abort
    notice: str = ""  # shown on the model card
    sla: SLA = field(default_factory=SLA)  # targets of the SLA-attainment (goodput) counters
    # On SIGTERM: answer new requests 503 and let those in flight finish for up to this long.
    drain_timeout_s: float = 30.0
    template_timeout_s: float = 2.0  # chat-template rendering, at most (slower: a 400)
    max_tokens_limit: int = 0  # max_tokens, at most (0: whatever the context leaves)
    # A request that arrives while the cluster is starting (no attention server ready yet)
    # waits this long for one, then gets a 503 'starting'.
    startup_wait_s: float = 60.0
    security: Security = field(default_factory=Security)  # TLS to the attention servers
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # vLLM's two flags: tool_choice "auto" (the default with tools) reads calls out of the
    # text with this parser, and only when enabled
    tool_call_parser: str = ""
    enable_auto_tool_choice: bool = False
    reasoning_parser: str = ""  # vLLM's flag: a thinking model's reasoning as reasoning_content
    chat_template: str = ""  # vLLM's flag: a template file (or text) in place of the model's
    # vLLM's flag: where requests' sampling defaults come from (auto: the model's
    # generation_config.json; vllm: none; else a directory holding one)
    generation_config: str = "auto"
    # vLLM's CORS flags, with its defaults: a browser page of any origin may call the API
    # (the API key still applies; no cookies)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_logprobs: int = 20  # vLLM's: alternatives a request may ask for, at most (-1: any)
    # vLLM's: chat-template variables every chat gets unless it sets them itself
    default_chat_template_kwargs: dict[str, Any] | None = None
    # the Responses API's store (GET by id, previous_response_id, background), in memory;
    # 0: nothing is stored
    responses_store_mb: int = 64
    # vLLM's request logging: each request's prompt and parameters, each choice's output,
    # at most this many characters of either (0: all)
    log_requests: bool = False
    log_outputs: bool = False
    max_log_len: int = 0
    # vLLM's: every stream ends with its usage, asked for or not
    force_include_usage: bool = False
    # vLLM's: logprobs name every token "token_id:N" (as the request field asks for one)
    tokens_as_token_ids: bool = False

    def __post_init__(self) -> None:
        check(bool(self.attention), "at least one attention server address is needed")
        names = (self.model_name, *self.model_aliases)
        check(all(names), "a served model name cannot be empty")
        check(len(set(names)) == len(names), f"served model names repeat: {' '.join(names)}")
        check(0 <= self.port < 65536, f"port {self.port} is not a port")
        check(self.max_body_bytes >= 1, "the body limit must be >= 1 byte")
        check(
            self.generate_timeout_s > 0 and self.rpc_timeout_s > 0,
            "request and RPC timeouts must be > 0",
        )
        check(self.drain_timeout_s >= 0, "the drain timeout must be >= 0")
        check(self.template_timeout_s > 0, "the template timeout must be > 0")
        check(self.max_tokens_limit >= 0, "the max_tokens limit must be >= 0 (0: none)")
        check(self.startup_wait_s >= 0, "the start-up wait must be >= 0")
        check(self.max_log_len >= 0, "--max-log-len must be >= 0 (0: no limit)")
        check(
            self.log_requests or not self.log_outputs,
            "--enable-log-outputs needs --enable-log-requests",
        )
        check(self.responses_store_mb >= 0, "--responses-store-mb must be >= 0 (0: no store)")
        check(self.max_logprobs >= -1, "--max-logprobs must be >= 0, or -1 for no limit")
        check(
            self.tool_call_parser in ("", *TOOL_PARSER_NAMES),
            f"no tool-call parser {self.tool_call_parser!r}; known: {', '.join(TOOL_PARSER_NAMES)}",
        )
        check(
            self.reasoning_parser in ("", *REASONING_PARSER_NAMES),
            f"no reasoning parser {self.reasoning_parser!r}; known: "
            f"{', '.join(REASONING_PARSER_NAMES)}",
        )
        check(
            bool(self.tool_call_parser) or not self.enable_auto_tool_choice,
            "--enable-auto-tool-choice needs a --tool-call-parser",
        )
