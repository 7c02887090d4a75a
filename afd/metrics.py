"""Every Prometheus metric afd exports, defined once (names follow vLLM's meaning with an `afd_`
prefix). Services import the objects from here; nothing else calls a metric constructor."""

from __future__ import annotations

from prometheus_client import Counter

# ------------------------------------------------------------------ gateway

GATEWAY_REQUESTS = Counter(
    "afd_gateway_requests",
    "HTTP requests answered by the gateway, by endpoint and status code",
    ["endpoint", "status"],
)
PROMPT_TOKENS = Counter("afd_prompt_tokens", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter("afd_generation_tokens", "Generated tokens of finished requests")
REQUEST_SUCCESS = Counter(
    "afd_request_success",
    "Choices that finished, by finish reason (stop, length, abort)",
    ["finished_reason"],
)
