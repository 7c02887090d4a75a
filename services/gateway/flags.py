"""`afd gateway`'s flags, each declared against the config field it fills (afd/flags.py). The
API group is also taken by `afd serve`, which passes it on to its gateway."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from afd import flags
from afd.errors import ConfigError
from afd.flags import build, option
from services.gateway.config import GatewayConfig
from services.gateway.harmony import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES
from services.gateway.latency import SLA
from services.gateway.routing import POLICIES, RoutingConfig

API_KEY_ENV = "AFD_API_KEY"  # the key from the environment keeps it out of the process list
API_KEY_FILE_ENV = "AFD_API_KEY_FILE"  # or from a file: a mounted Secret


def add_api_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """What the HTTP API accepts and promises; returns the actions (afd.flags.forward)."""
    g = p.add_argument_group("HTTP API")
    c = GatewayConfig
    return [
        option(
            g, "--private-metrics", c, "public_metrics", help="require the API key for /metrics too"
        ),
        option(g, "--max-body-bytes", c, "max_body_bytes", help="largest request body"),
        option(
            g,
            "--default-chat-template-kwargs",
            c,
            "default_chat_template_kwargs",
            type=flags.json_object,
            help="chat-template variables every chat gets unless it sets them, as a JSON "
            "object (Qwen3: '{\"enable_thinking\": false}')",
        ),
        option(
            g,
            "--max-logprobs",
            c,
            "max_logprobs",
            help="alternatives (logprobs, top_logprobs, prompt_logprobs) a request may ask for; "
            "-1: the whole vocabulary",
        ),
        option(
            g,
            "--enable-force-include-usage",
            c,
            "force_include_usage",
            help="every stream ends with a usage chunk, as if stream_options.include_usage",
        ),
        option(
            g,
            "--return-tokens-as-token-ids",
            c,
            "tokens_as_token_ids",
            help='logprobs name each token "token_id:N" (for tokens whose text is not valid '
            "UTF-8 alone), as a request's return_tokens_as_token_ids does",
        ),
        option(
            g,
            "--enable-log-requests",
            c,
            "log_requests",
            help="log each request's prompt and sampling parameters (users' data: off by default)",
        ),
        option(
            g,
            "--enable-log-outputs",
            c,
            "log_outputs",
            help="log each choice's output as it finishes too (needs --enable-log-requests)",
        ),
        option(
            g, "--max-log-len", c, "max_log_len", help="characters of a logged prompt or output"
        ),
        option(
            g,
            "--responses-store-mb",
            c,
            "responses_store_mb",
            help="memory for stored Responses API responses (GET by id, previous_response_id, "
            "background), least recently used dropped first; 0: none stored",
        ),
        *(
            option(
                g,
                flag,
                c,
                name,
                type=flags.json_strings,
                help=f"CORS: allowed {what}, as a JSON list",
            )
            for flag, name, what in (
                ("--allowed-origins", "allowed_origins", "origins"),
                ("--allowed-methods", "allowed_methods", "methods"),
                ("--allowed-headers", "allowed_headers", "headers"),
            )
        ),
        option(g, "--allow-credentials", c, "allow_credentials", help="CORS: allow credentials"),
        option(g, "--request-timeout", c, "generate_timeout_s", help="deadline per request, s"),
        option(
            g,
            "--template-timeout",
            c,
            "template_timeout_s",
            help="chat-template rendering time limit, s (a slower render is a 400)",
        ),
        option(
            g,
            "--max-tokens-limit",
            c,
            "max_tokens_limit",
            help="largest max_tokens accepted (0: whatever the context leaves after the prompt)",
        ),
        option(
            g,
            "--startup-wait",
            c,
            "startup_wait_s",
            help="a request that arrives while the cluster is starting waits this long for an "
            "attention server to be ready (then a 503 'starting'), s",
        ),
        option(
            g,
            "--chat-template",
            c,
            "chat_template",
            help="a chat template file (or the template itself) to use instead of the model's",
        ),
        option(
            g,
            "--generation-config",
            c,
            "generation_config",
            help="sampling defaults for the fields a request leaves out: auto (the model's "
            "generation_config.json), vllm (none: the API's), or a directory holding one",
        ),
        option(
            g,
            "--tool-call-parser",
            c,
            "tool_call_parser",
            choices=["", *TOOL_PARSER_NAMES],
            help="how tool calls are read out of the model's text (vLLM's names: hermes for "
            "Qwen 2.5, Qwen3, Hermes; deepseek_v3 for DeepSeek-V3 and R1-0528; deepseek_v31 "
            "for DeepSeek-V3.1 and V3.2; mistral for Mistral and Mixtral; step3 for Step-3; "
            "openai for gpt-oss)",
        ),
        option(
            g,
            "--enable-auto-tool-choice",
            c,
            "enable_auto_tool_choice",
            help='let the model decide to call tools (tool_choice "auto", the default when a '
            "request lists tools); needs --tool-call-parser",
        ),
        option(
            g,
            "--reasoning-parser",
            c,
            "reasoning_parser",
            choices=["", *REASONING_PARSER_NAMES],
            help="split a thinking model's reasoning off its chat answers, as reasoning_content "
            "(vLLM's names: qwen3, deepseek_r1, step3; gpt-oss's is read without one)",
        ),
        option(g, "--sla-ttft", SLA, "ttft_s", help="TTFT target, s, for goodput (0: none)"),
        option(
            g,
            "--sla-tpot",
            SLA,
            "tpot_s",
            help="time-per-output-token target, s, for goodput (0: none)",
        ),
        *add_routing_flags(p),
    ]


def add_routing_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """How requests are spread over the attention servers (services/gateway/routing.py)."""
    g = p.add_argument_group("routing across attention servers")
    r = RoutingConfig
    return [
        option(
            g,
            "--routing",
            r,
            "policy",
            choices=POLICIES,
            help="prefix: prompts that start alike go to one server (its prefix cache holds "
            "them), unless it is overloaded; least-loaded; round-robin",
        ),
        option(
            g,
            "--routing-prefix-tokens",
            r,
            "prefix_tokens",
            help="prefix routing: the tokens of a prompt's start that choose its server",
        ),
        option(
            g,
            "--routing-balance-abs",
            r,
            "balance_abs",
            help="prefix routing: the chosen server may carry this many more requests than the "
            "idlest one...",
        ),
        option(
            g,
            "--routing-balance-ratio",
            r,
            "balance_ratio",
            help="... and this factor more, before the idlest one takes the request",
        ),
    ]


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    option(
        p,
        "--api-key",
        GatewayConfig,
        "api_key",
        help=f"require this key (Authorization: Bearer); default: ${API_KEY_ENV}, which keeps "
        "the key out of the process list",
    )
    p.add_argument(
        "--api-key-file",
        default="",
        help=f"read the key from this file (a mounted Secret); default: ${API_KEY_FILE_ENV}",
    )


def api_key(args: argparse.Namespace) -> str:
    """The key: --api-key, else --api-key-file, else $AFD_API_KEY, else $AFD_API_KEY_FILE's
    file; empty: no authentication. Raises ConfigError for a file that cannot be read or holds
    no key (a typo must not turn authentication off)."""
    if args.api_key:
        return args.api_key
    path = args.api_key_file or (
        "" if os.environ.get(API_KEY_ENV) else os.environ.get(API_KEY_FILE_ENV, "")
    )
    if not path:
        return os.environ.get(API_KEY_ENV, "")
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the API key file {path!r}: {e.strerror}") from e
    if not key:
        raise ConfigError(f"the API key file {path!r} is empty")
    return key


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--model", help="model directory for the tokenizer (default: the demo model)")
    p.add_argument(
        "--attention",
        required=True,
        help="attention servers' control-plane addresses, HOST:PORT, comma-separated",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        help="the model's name in the API (default: its directory's name); further names are "
        "accepted too, and responses carry the first",
    )
    option(p, "--host", GatewayConfig, "host", help="interface to serve HTTP on")
    option(p, "--port", GatewayConfig, "port")
    add_api_key_flag(p)
    add_api_flags(p)
    option(
        p,
        "--drain-timeout",
        GatewayConfig,
        "drain_timeout_s",
        help="on SIGTERM: answer new requests 503 and let those in flight finish for up to "
        "this many seconds, then exit 0",
    )
    flags.add_security_flags(p, curve=False)
    return p


def config(args: argparse.Namespace) -> GatewayConfig:
    notice = ""
    if args.model:
        model_dir = args.model
    else:
        from afd.demo import DEMO_NOTICE, demo_model_dir

        model_dir, notice = str(demo_model_dir()), DEMO_NOTICE
    return build(
        GatewayConfig,
        args,
        model_dir=model_dir,
        attention=tuple(a.strip() for a in args.attention.split(",") if a.strip()),
        model_name=(args.served_model_name or [flags.served_name(args.model)])[0],
        model_aliases=tuple((args.served_model_name or [])[1:]),
        api_key=api_key(args),
        notice=notice,
        sla=build(SLA, args),
        routing=build(RoutingConfig, args),
        security=flags.security(args),
    )
