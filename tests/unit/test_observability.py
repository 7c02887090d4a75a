"""Observability without processes: the round-trip breakdown, straggler detection, the
gateway's latency and SLA metrics (against a fake attention server), and the bench's figures."""

import argparse
import asyncio
import logging

import httpx
import pytest
from prometheus_client import REGISTRY

from afd import metrics
from afd.demo import write_tokenizer
from afd.errors import ConfigError
from afd.messages import Trace
from afd.metrics import ROUNDTRIP_PARTS
from afd.tokenizer import ModelTokenizer
from afd_cli.bench import serve_report as report
from services.attention.stragglers import StragglerConfig, StragglerDetector, Verdict
from services.attention.telemetry import breakdown
from services.gateway.app import GatewayConfig, create_app
from services.gateway.balancer import Balancer
from services.gateway.detok import TokenBytes
from services.gateway.handlers import GatewayState
from services.gateway.latency import SLA
from tests.unit.test_gateway_app import FakeClient

# ------------------------------------------------------------------ round-trip breakdown


def test_breakdown_parts_sum_to_the_round_trip_on_two_clocks():
    # The FFN host's clock is 1000 s off: only same-host differences may be used.
    a, f = 100.0, 1100.0
    tr = Trace(
        a_send=a,
        a_sent=a + 0.001,
        f_recv=f + 0.003,
        f_compute_start=f + 0.004,
        f_compute_end=f + 0.010,
        f_send=f + 0.0105,
        a_recv=a + 0.016,
    )
    rt, parts = breakdown(tr)
    got = dict(zip(ROUNDTRIP_PARTS, parts, strict=True))
    assert rt == pytest.approx(0.016)
    assert got["a2f_send"] == pytest.approx(0.001)
    assert got["ffn_queue"] == pytest.approx(0.001)
    assert got["ffn_compute"] == pytest.approx(0.006)
    assert got["f2a_send"] == pytest.approx(0.0005)
    # net cost: round trip - attention send - FFN residence (7.5 ms)
    assert got["network"] == pytest.approx(0.016 - 0.001 - 0.0075)
    assert sum(parts) == pytest.approx(rt)


# ------------------------------------------------------------------ stragglers

FAST = (0.0001, 0.0008, 0.0001, 0.0010, 0.0001)  # parts, s: 2.1 ms round trip


def _feed(det, t, slow_peer=None, slow_part=None, extra=0.010, n=30):
    for i in range(n):
        for peer in ("a", "b", "c")[: det_peers(det)]:
            parts = list(FAST)
            if peer == slow_peer:
                parts[ROUNDTRIP_PARTS.index(slow_part)] += extra
            det.add(peer, t + i * 0.001, sum(parts), tuple(parts))


def det_peers(det):
    return len(det.peers)


@pytest.mark.parametrize(
    "part, name",
    [("ffn_compute", "FFN compute"), ("network", "network"), ("a2f_send", "attention send")],
)
def test_a_slow_peer_is_flagged_after_consecutive_checks_naming_the_slow_part(part, name, caplog):
    cfg = StragglerConfig(factor=2.0, checks=3, window_s=5.0, interval_s=1.0)
    det = StragglerDetector(cfg, ["a", "b"])
    caplog.set_level(logging.INFO, "afd.attention.stragglers")
    for check in range(3):
        t = 10.0 + check
        _feed(det, t - 0.5, slow_peer="b", slow_part=part)
        assert det.maybe_check(t)
        assert det.flagged("b") == (check == 2), check  # only after 3 checks in a row
        assert not det.flagged("a")
    assert det.last["b"].slow_part == part
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "FFN peer b is a straggler" in warnings[0] and f"slow part: {name}" in warnings[0]
    # Back to normal speed: the flag clears at the next check once the window has moved on.
    _feed(det, 20.0)
    det.check(20.1 + cfg.window_s - 0.5)
    assert not det.flagged("b")
    assert "no longer a straggler" in caplog.records[-1].getMessage()


def test_no_straggler_in_an_even_pool_or_a_pool_of_one():
    det = StragglerDetector(StragglerConfig(checks=1), ["a", "b", "c"])
    _feed(det, 1.0)
    det.check(1.1)
    assert not any(det.flagged(p) for p in "abc")
    alone = StragglerDetector(StragglerConfig(checks=1), ["a"])
    for i in range(50):
        alone.add("a", 1.0 + i * 1e-3, 1.0, FAST)  # slow, but there is nothing to compare with
    alone.check(1.1)
    assert not alone.flagged("a")


def test_too_few_samples_are_not_judged():
    det = StragglerDetector(StragglerConfig(checks=1, min_samples=20), ["a", "b"])
    _feed(det, 1.0, slow_peer="b", slow_part="ffn_compute", n=10)
    det.check(1.1)
    assert not det.flagged("b")


def test_verdict_ratio_and_validation():
    v = Verdict("p", 0.02, 0.005, FAST, FAST)
    assert v.ratio == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="factor"):
        StragglerConfig(factor=1.0)
    with pytest.raises(ConfigError):
        StragglerConfig(checks=0)


# ------------------------------------------------------------------ gateway metrics


def _value(name, labels=None):
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


GATEWAY_SAMPLES = [
    ("afd_request_sla_checked_total", None),
    ("afd_request_sla_ttft_met_total", None),
    ("afd_request_sla_tpot_met_total", None),
    ("afd_request_goodput_total", None),
    ("afd_time_to_first_token_seconds_count", None),
    ("afd_e2e_request_latency_seconds_count", None),
    ("afd_request_time_per_output_token_seconds_count", None),
    ("afd_inter_token_latency_seconds_count", None),
    ("afd_request_queue_time_seconds_count", None),
    ("afd_generation_tokens_total", None),
    ("afd_request_success_total", {"finished_reason": "length"}),
    ("afd_gateway_requests_total", {"endpoint": "/v1/completions", "status": "200"}),
    ("afd_gateway_requests_total", {"endpoint": "/v1/completions", "status": "400"}),
]


def _snapshot():
    return {(n, tuple(sorted((lb or {}).items()))): _value(n, lb) for n, lb in GATEWAY_SAMPLES}


def _delta(before):
    after = _snapshot()
    return {k[0] + (str(dict(k[1])) if k[1] else ""): after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return ModelTokenizer(d)


def _gateway(tokenizer, sla: SLA):
    state = GatewayState(tokenizer, TokenBytes(tokenizer), Balancer([FakeClient()]), "m", 320)
    app = create_app(state, GatewayConfig("unused", ("fake:1",), "m", sla=sla))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def _workload(c) -> int:
    """3 requests, one of them with n=2 (4 choices of 6 tokens), and one bad request."""
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0}
    r1 = await c.post("/v1/completions", json=body)
    r2 = await c.post("/v1/completions", json={**body, "stream": True})
    r3 = await c.post("/v1/completions", json={**body, "n": 2})
    bad = await c.post("/v1/completions", json={**body, "max_tokens": -1})
    assert [r.status_code for r in (r1, r2, r3, bad)] == [200, 200, 200, 400]
    return sum(r.json()["usage"]["completion_tokens"] for r in (r1, r3)) + 6


def test_gateway_metrics_count_the_workload_and_sla_attainment(tokenizer):
    metrics.register("gateway")
    before = _snapshot()
    tokens = asyncio.run(_workload(_gateway(tokenizer, SLA(ttft_s=60.0, tpot_s=60.0))))
    d = _delta(before)
    assert tokens == 24
    choices = 4
    assert d["afd_request_success_total{'finished_reason': 'length'}"] == choices
    assert d["afd_gateway_requests_total{'endpoint': '/v1/completions', 'status': '200'}"] == 3
    assert d["afd_gateway_requests_total{'endpoint': '/v1/completions', 'status': '400'}"] == 1
    assert d["afd_generation_tokens_total"] == tokens
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert d[f"afd_{h}_seconds_count"] == choices, h
    assert d["afd_request_time_per_output_token_seconds_count"] == choices
    assert d["afd_inter_token_latency_seconds_count"] == tokens - choices  # one event per token
    # A generous SLA: every choice meets both targets.
    for c in ("sla_checked", "sla_ttft_met", "sla_tpot_met", "goodput"):
        assert d[f"afd_request_{c}_total"] == choices, c
    assert _value("afd_sla_tpot_seconds") == 60.0


def test_an_impossible_sla_is_met_by_nobody(tokenizer):
    before = _snapshot()
    asyncio.run(_workload(_gateway(tokenizer, SLA(ttft_s=1e-9, tpot_s=1e-9))))
    d = _delta(before)
    assert d["afd_request_sla_checked_total"] == 4
    assert d["afd_request_sla_ttft_met_total"] == 0
    assert d["afd_request_sla_tpot_met_total"] == 0
    assert d["afd_request_goodput_total"] == 0
    assert _value("afd_sla_ttft_seconds") == 1e-9


def test_sla_semantics():
    assert SLA(0.0, 0.0).met(100.0, 100.0) == (True, True)  # 0: no target
    assert SLA(0.5, 0.05).met(0.6, None) == (False, True)  # one token: no TPOT to miss
    assert SLA(0.5, 0.05).met(0.5, 0.051) == (True, False)


def test_metric_groups_are_registered_once_and_named_once():
    metrics.register("gateway")
    metrics.register("gateway")  # idempotent
    names = metrics.exposed_names()
    assert all(n.startswith("afd_") for n in names)
    assert names["afd_attention_layer_seconds"] == "histogram"
    assert names["afd_ffn_roundtrip_seconds"] == "histogram"
    assert names["afd_ffn_compute_seconds"] == "histogram"
    assert metrics.LAYER_BUCKETS[0] <= 1e-4 and metrics.REQUEST_BUCKETS[0] <= 1e-3
    assert 0.05 in metrics.TOKEN_BUCKETS  # the Step-3 TPOT target is a bucket boundary


# ------------------------------------------------------------------ afd bench serve figures


def _args(**kw):
    base = dict(
        base_url="http://x/v1", endpoint="completions", concurrency=2, request_rate=0.0,
        sla_ttft=0.1, sla_tpot=0.02,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_bench_summary_percentiles_goodput_and_failures():
    ok = [
        report.Result(True, ttft=0.05, e2e=0.05 + 0.01 * 9, itl=[0.01] * 9, output_tokens=10),
        report.Result(True, ttft=0.20, e2e=0.20 + 0.01 * 9, itl=[0.01] * 9, output_tokens=10),
        report.Result(True, ttft=0.05, e2e=0.05 + 0.03 * 9, itl=[0.03] * 9, output_tokens=10),
    ]
    bad = report.Result(False, error="HTTP 503: busy")
    s = report.summarize([*ok, bad], 2.0, _args(), "m")
    assert (s["completed"], s["failed"], s["errors"]) == (3, 1, ["HTTP 503: busy"])
    assert s["good_requests"] == 1  # one TTFT too slow, one TPOT too slow
    assert s["goodput"] == pytest.approx(0.5)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(15.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.05)
    assert s["tpot_s"]["mean"] == pytest.approx((0.01 + 0.01 + 0.03) / 3)
    assert "TTFT" in report.table(s) and "goodput" in report.table(s)
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
