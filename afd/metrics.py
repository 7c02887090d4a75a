"""Every Prometheus metric afd exports, defined once (names follow vLLM's meaning with an `afd_`
prefix). Services import the objects from here; nothing else calls a metric constructor.

The objects are built unregistered and grouped by the service that exports them; a service
calls `register(...)` for its own group when it starts, so each /metrics shows only what that
service measures (a gateway never shows an empty attention-step histogram). Counting into an
unregistered object is harmless (tests that run a listener in-process do it).

Buckets are fine at the low end: a CPU model decodes in milliseconds and a layer takes tens of
microseconds, far below vLLM's GPU-sized buckets.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from afd.engine_histogram import EngineHistogram


def _decades(lo: int, hi: int, steps: Iterable[float]) -> tuple[float, ...]:
    """steps x 10**e for e in lo..hi-1, plus 10**hi: e.g. (1, 2.5, 5) per decade."""
    steps = tuple(steps)
    return tuple(round(s * 10.0**e, 12) for e in range(lo, hi) for s in steps) + (10.0**hi,)


# Request latencies (TTFT, e2e, queue): 0.1 ms .. 2560 s.
REQUEST_BUCKETS = _decades(-4, 3, (1, 2, 3, 5, 7.5)) + (2560.0,)
# Per-token gaps (ITL, TPOT): 0.1 ms .. 80 s; 50 ms (the Step-3 TPOT target) is a boundary.
TOKEN_BUCKETS = _decades(-4, 1, (1, 2, 2.5, 5, 7.5)) + (20.0, 40.0, 80.0)
# One layer, one FFN call or one part of a round trip: 10 us .. 10 s.
LAYER_BUCKETS = _decades(-5, 1, (1, 2, 3, 5, 7))
# A whole engine step: 0.1 ms .. 100 s.
STEP_BUCKETS = _decades(-4, 2, (1, 2, 3, 5, 7))
COUNT_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384 (tokens per step or call)
PEER_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)


# Names other modules (the planner, the dashboard test) refer to as strings.
ATTENTION_LAYER_SECONDS = "afd_attention_layer_seconds"
FFN_COMPUTE_SECONDS = "afd_ffn_compute_seconds"
FFN_ROUNDTRIP_SECONDS = "afd_ffn_roundtrip_seconds"
FFN_ROUNDTRIP_PART_SECONDS = "afd_ffn_roundtrip_part_seconds"
FFN_STRAGGLER = "afd_ffn_straggler"
PEER_LABEL = "peer"
PART_LABEL = "part"
# The parts of one attention -> FFN -> attention round trip, in order; they sum to the whole.
# a2f_send: attention host, encode and hand to the socket (StepMesh: post-send - push start)
# network: both wire legs and socket buffering (StepMesh net_cost: round trip - FFN residence).
#   It also holds what no stamp can see: a message waiting in a ZeroMQ FFN server's socket while
#   that server computes another layer (its listener stamps arrival when it takes the message;
#   the gRPC one on arrival), and a reply that lands while the attention thread computes (taken,
#   and stamped, at its next visit to the FFN pool).
# ffn_queue: FFN host, arrival to compute start; ffn_compute: the layer call
# f2a_send: FFN host, compute end to the reply's send stamp
ROUNDTRIP_PARTS = ("a2f_send", "network", "ffn_queue", "ffn_compute", "f2a_send")

# ------------------------------------------------------------------ gateway

GATEWAY_REQUESTS = Counter(
    "afd_gateway_requests",
    "HTTP requests answered by the gateway, by endpoint and status code",
    ["endpoint", "status"],
    registry=None,
)
PROMPT_TOKENS = Counter("afd_prompt_tokens", "Prompt tokens of finished requests", registry=None)
GENERATION_TOKENS = Counter(
    "afd_generation_tokens", "Generated tokens of finished requests", registry=None
)
REQUEST_SUCCESS = Counter(
    "afd_request_success",
    "Choices that finished, by finish reason (stop, length, abort)",
    ["finished_reason"],
    registry=None,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "afd_time_to_first_token_seconds",
    "Time from the request's arrival at the gateway to the choice's first token",
    buckets=REQUEST_BUCKETS,
    registry=None,
)
INTER_TOKEN_LATENCY = Histogram(
    "afd_inter_token_latency_seconds",
    "Gap between consecutive token events of one choice",
    buckets=TOKEN_BUCKETS,
    registry=None,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "afd_request_time_per_output_token_seconds",
    "Per choice: (end-to-end latency - time to first token) / (output tokens - 1)",
    buckets=TOKEN_BUCKETS,
    registry=None,
)
E2E_LATENCY = Histogram(
    "afd_e2e_request_latency_seconds",
    "Time from the request's arrival at the gateway to the choice's last token",
    buckets=REQUEST_BUCKETS,
    registry=None,
)
QUEUE_TIME = Histogram(
    "afd_request_queue_time_seconds",
    "Time a choice waited on its attention server before it was first scheduled",
    buckets=REQUEST_BUCKETS,
    registry=None,
)
SLA_TTFT = Gauge("afd_sla_ttft_seconds", "The configured TTFT SLA (0: none)", registry=None)
SLA_TPOT = Gauge("afd_sla_tpot_seconds", "The configured TPOT SLA (0: none)", registry=None)
SLA_TTFT_MET = Counter(
    "afd_request_sla_ttft_met",
    "Finished choices whose time to first token met the TTFT SLA",
    registry=None,
)
SLA_TPOT_MET = Counter(
    "afd_request_sla_tpot_met",
    "Finished choices whose time per output token met the TPOT SLA",
    registry=None,
)
GOODPUT = Counter(
    "afd_request_goodput",
    "Finished choices that met every SLA (TTFT and TPOT): goodput",
    registry=None,
)
SLA_CHECKED = Counter(
    "afd_request_sla_checked",
    "Finished choices checked against the SLAs (the denominator of the attainment ratios)",
    registry=None,
)

ROUTE_REASONS = ("prefix", "balance", "least_loaded", "round_robin")
ROUTED = Counter(
    "afd_gateway_routed",
    "Requests sent to each attention server, by why it was chosen: prefix (the prompt's "
    "prefix owner), balance (the owner was too loaded: the idlest instead), least_loaded, "
    "round_robin",
    ["server", "reason"],
    registry=None,
)
SERVER_PREFIX_HIT_RATE = Gauge(
    "afd_gateway_server_prefix_cache_hit_rate",
    "Each attention server's prefix-cache hit rate since it started (prompt tokens found in "
    "the cache / prompt tokens admitted), as last polled",
    ["server"],
    registry=None,
)

# ------------------------------------------------------------------ attention server

NUM_RUNNING = Gauge("afd_num_requests_running", "Requests in the running batch", registry=None)
NUM_WAITING = Gauge("afd_num_requests_waiting", "Requests waiting to be scheduled", registry=None)
KV_USAGE = Gauge(
    "afd_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 .. 1)", registry=None
)
PREEMPTIONS = Counter(
    "afd_num_preemptions", "Requests preempted to free KV cache blocks", registry=None
)
PREFIX_QUERIES = Counter(
    "afd_prefix_cache_queries",
    "Prompt tokens of admitted requests, looked up in the prefix cache (tokens)",
    registry=None,
)
PREFIX_HITS = Counter(
    "afd_prefix_cache_hits",
    "Prompt tokens whose K/V the prefix cache supplied (tokens; hits / queries = hit rate)",
    registry=None,
)
SPEC_DRAFTS = Counter(
    "afd_spec_decode_num_drafts",
    "Speculative decoding: request steps that verified drafts (one per request and step)",
    registry=None,
)
SPEC_DRAFT_TOKENS = Counter(
    "afd_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified", registry=None
)
SPEC_ACCEPTED_TOKENS = Counter(
    "afd_spec_decode_num_accepted_tokens",
    "Speculative decoding: draft tokens kept (accepted / draft tokens = acceptance rate)",
    registry=None,
)
SPEC_ACCEPTED_PER_POS = Counter(
    "afd_spec_decode_num_accepted_tokens_per_pos",
    "Speculative decoding: drafts kept at each position of a request's drafts (0: the first; "
    "kept at i / verified steps = how often i + 1 drafts hold)",
    ["position"],
    registry=None,
)
STEP_SECONDS = Histogram(
    "afd_attention_step_seconds",
    "One engine step (schedule, execute, update) on an attention server",
    buckets=STEP_BUCKETS,
    registry=None,
)
STEP_TOKENS = Histogram(
    "afd_attention_step_tokens",
    "Tokens computed in one engine step (prefill and decode together)",
    buckets=COUNT_BUCKETS,
    registry=None,
)
MICRO_BATCHES_IN_FLIGHT = Gauge(
    "afd_attention_micro_batches_in_flight",
    "Most micro-batches with FFN work outstanding at once during the last step",
    registry=None,
)
ATTENTION_LAYER = EngineHistogram(
    ATTENTION_LAYER_SECONDS,
    "Attention-side compute of one layer of one micro-batch (attention, router, quantize): "
    "engine-thread time between handing the previous work to the FFN pool and the next send",
    [],
    LAYER_BUCKETS,
)
FFN_ROUNDTRIP = EngineHistogram(
    FFN_ROUNDTRIP_SECONDS,
    "Attention -> FFN -> attention round trip of one layer's message, per FFN peer "
    "(attention-host clock: send start to the reply's arrival)",
    [PEER_LABEL],
    LAYER_BUCKETS,
)
FFN_ROUNDTRIP_PART = EngineHistogram(
    FFN_ROUNDTRIP_PART_SECONDS,
    "The round trip split StepMesh-style (each part measured on one host): a2f_send, "
    "network, ffn_queue, ffn_compute, f2a_send",
    [PEER_LABEL, PART_LABEL],
    LAYER_BUCKETS,
)
STRAGGLER = Gauge(
    FFN_STRAGGLER,
    "1 while this FFN peer's round-trip p99 stays above the pool median by the straggler factor",
    [PEER_LABEL],
    registry=None,
)
FFN_PAUSED = Gauge(
    "afd_ffn_paused",
    "1 while the engine holds its requests for an expert shard with no live FFN replica "
    "(within --ffn-grace)",
    registry=None,
)

# ------------------------------------------------------------------ FFN server

FFN_MESSAGES = Counter("afd_ffn_messages", "Layer messages computed", registry=None)
FFN_TOKENS = Counter(
    "afd_ffn_tokens", "Tokens computed (summed over layer messages)", registry=None
)
FFN_BATCH_TOKENS = Histogram(
    "afd_ffn_batch_tokens",
    "Tokens in one layer call (the messages of one layer computed together)",
    buckets=COUNT_BUCKETS,
    registry=None,
)
FFN_BATCH_MESSAGES = Histogram(
    "afd_ffn_batch_messages",
    "Messages merged into one layer call",
    buckets=PEER_BUCKETS,
    registry=None,
)
FFN_BATCH_PEERS = Histogram(
    "afd_ffn_batch_peers",
    "Distinct attention peers (connections) merged into one layer call",
    buckets=PEER_BUCKETS,
    registry=None,
)
FFN_COMPUTE = Histogram(
    FFN_COMPUTE_SECONDS,
    "Compute of one layer call on an FFN server",
    buckets=LAYER_BUCKETS,
    registry=None,
)
FFN_QUEUE = Histogram(
    "afd_ffn_queue_seconds",
    "Per message: arrival at the FFN server's listener to the start of its layer call",
    buckets=LAYER_BUCKETS,
    registry=None,
)
FFN_ERRORS = Counter(
    "afd_ffn_errors",
    "Error replies sent by an FFN server, by error code (bad_request, deadline_exceeded, ...)",
    ["code"],
    registry=None,
)

WORKSPACE_LOOKUPS = Counter(
    "afd_ffn_expert_workspace_lookups",
    "MXFP4 experts looked up in the converted-expert workspace, by result (hit, miss)",
    ["result"],
    registry=None,
)
WORKSPACE_CONVERSION = Histogram(
    "afd_ffn_expert_workspace_conversion_seconds",
    "Converting one MXFP4 expert (both its matrices) into the compute dtype on a miss",
    buckets=LAYER_BUCKETS,
    registry=None,
)
WORKSPACE_EVICTIONS = Counter(
    "afd_ffn_expert_workspace_evictions",
    "Converted experts evicted (least recently used) to make room",
    registry=None,
)
WORKSPACE_BYTES = Gauge(
    "afd_ffn_expert_workspace_bytes", "Bytes of converted experts held", registry=None
)

GATEWAY = (
    GATEWAY_REQUESTS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    TIME_PER_OUTPUT_TOKEN,
    E2E_LATENCY,
    QUEUE_TIME,
    SLA_TTFT,
    SLA_TPOT,
    SLA_TTFT_MET,
    SLA_TPOT_MET,
    GOODPUT,
    SLA_CHECKED,
    ROUTED,
    SERVER_PREFIX_HIT_RATE,
)
ATTENTION = (
    NUM_RUNNING,
    NUM_WAITING,
    KV_USAGE,
    PREEMPTIONS,
    PREFIX_QUERIES,
    PREFIX_HITS,
    SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_ACCEPTED_PER_POS,
    STEP_SECONDS,
    STEP_TOKENS,
    MICRO_BATCHES_IN_FLIGHT,
    ATTENTION_LAYER,
    FFN_ROUNDTRIP,
    FFN_ROUNDTRIP_PART,
    STRAGGLER,
    FFN_PAUSED,
)
FFN = (
    FFN_MESSAGES,
    FFN_TOKENS,
    FFN_BATCH_TOKENS,
    FFN_BATCH_MESSAGES,
    FFN_BATCH_PEERS,
    FFN_COMPUTE,
    FFN_QUEUE,
    FFN_ERRORS,
    WORKSPACE_LOOKUPS,
    WORKSPACE_CONVERSION,
    WORKSPACE_EVICTIONS,
    WORKSPACE_BYTES,
)
GROUPS = {"gateway": GATEWAY, "attention": ATTENTION, "ffn": FFN}

_registered: set[tuple[int, str]] = set()


def register(service: str, registry: CollectorRegistry = REGISTRY) -> None:
    """Export `service`'s metrics ("gateway", "attention" or "ffn") on `registry`; idempotent."""
    key = (id(registry), service)
    if key in _registered:
        return
    for m in GROUPS[service]:
        registry.register(m)
    _registered.add(key)


def exposed_names() -> dict[str, str]:
    """Every exported family name -> its type, as /metrics writes it (counters end in _total;
    histograms add _bucket, _sum and _count to the name given here)."""
    out = {}
    for group in GROUPS.values():
        for m in group:
            kind = m._type  # prometheus_client has no public accessor for these two
            name = m._name + ("_total" if kind == "counter" else "")
            out[name] = kind
    return out
