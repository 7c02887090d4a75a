"""Reading a live cluster's Prometheus metrics and turning them into an x:y and S advice."""

import math

import pytest

from afd.plan.errors import PlanError
from afd.plan.metrics_input import (
    ATTENTION_LAYER_SECONDS,
    FFN_COMPUTE_SECONDS,
    FFN_ROUNDTRIP_SECONDS,
    Measured,
    histogram,
    measured_times,
    parse_exposition,
    recommend,
)

# One attention server talking to two FFN servers; attention 2 ms per layer, FFN 0.5 ms per call.
ATTENTION = f"""\
# HELP {ATTENTION_LAYER_SECONDS} Attention compute of one layer of one micro-batch.
# TYPE {ATTENTION_LAYER_SECONDS} histogram
{ATTENTION_LAYER_SECONDS}_bucket{{le="0.001"}} 0
{ATTENTION_LAYER_SECONDS}_bucket{{le="0.0025"}} 90
{ATTENTION_LAYER_SECONDS}_bucket{{le="+Inf"}} 100
{ATTENTION_LAYER_SECONDS}_sum 0.2
{ATTENTION_LAYER_SECONDS}_count 100
# TYPE {FFN_ROUNDTRIP_SECONDS} histogram
{FFN_ROUNDTRIP_SECONDS}_bucket{{peer="ffn0",le="+Inf"}} 100
{FFN_ROUNDTRIP_SECONDS}_sum{{peer="ffn0"}} 0.1
{FFN_ROUNDTRIP_SECONDS}_count{{peer="ffn0"}} 100
{FFN_ROUNDTRIP_SECONDS}_bucket{{peer="tcp://10.0.0.2:5555",le="+Inf"}} 100
{FFN_ROUNDTRIP_SECONDS}_sum{{peer="tcp://10.0.0.2:5555"}} 0.3
{FFN_ROUNDTRIP_SECONDS}_count{{peer="tcp://10.0.0.2:5555"}} 100
afd_num_requests_running{{model="demo \\"x\\""}} 3 1712000000000
"""
FFN = f"""\
# TYPE {FFN_COMPUTE_SECONDS} histogram
{FFN_COMPUTE_SECONDS}_bucket{{le="0.001"}} 200
{FFN_COMPUTE_SECONDS}_bucket{{le="+Inf"}} 200
{FFN_COMPUTE_SECONDS}_sum 0.1
{FFN_COMPUTE_SECONDS}_count 200
"""


def test_metric_names_are_the_documented_contract():
    assert ATTENTION_LAYER_SECONDS == "afd_attention_layer_seconds"
    assert FFN_COMPUTE_SECONDS == "afd_ffn_compute_seconds"
    assert FFN_ROUNDTRIP_SECONDS == "afd_ffn_roundtrip_seconds"


def test_parse_exposition_labels_escapes_and_timestamps():
    samples = parse_exposition(ATTENTION)
    gauge = samples[-1]
    assert gauge.name == "afd_num_requests_running" and gauge.value == 3
    assert gauge.label("model") == 'demo "x"'
    inf = [s for s in samples if s.label("le") == "+Inf"]
    assert len(inf) == 3
    with pytest.raises(PlanError, match="line 1 is not a Prometheus sample"):
        parse_exposition("this is not metrics\n")


def test_histogram_mean_and_quantile():
    h = histogram(parse_exposition(ATTENTION), ATTENTION_LAYER_SECONDS)
    assert h.count == 100 and h.mean == pytest.approx(0.002)
    assert h.quantile(0.5) == pytest.approx(0.001 + 0.0015 * 50 / 90)
    assert h.quantile(0.99) == 0.0025  # in the +Inf bucket: its lower bound
    peer = histogram(parse_exposition(ATTENTION), FFN_ROUNDTRIP_SECONDS, peer="ffn0")
    assert peer.mean == pytest.approx(0.001)
    assert histogram(parse_exposition(FFN), "absent") is None


def test_measured_times_from_several_sources():
    m = measured_times([ATTENTION, FFN])
    assert m.attention_layer_s == pytest.approx(0.002)
    assert m.ffn_compute_s == pytest.approx(0.0005)
    assert m.roundtrip_s == pytest.approx(0.002)
    assert m.ffn_servers == 2 and dict(m.roundtrip_by_peer)["ffn0"] == pytest.approx(0.001)
    with pytest.raises(PlanError, match="afd_ffn_compute_seconds.*missing"):
        measured_times([ATTENTION])


def test_recommend_balances_attention_and_ffn():
    rec = recommend(measured_times([ATTENTION, FFN]))
    # one FFN call of the 2-server pool is 0.5 ms; all experts on one server: 1 ms vs 2 ms attention
    assert rec.ratio == pytest.approx(2.0)
    assert (rec.attention_servers, rec.ffn_servers) == (2, 1)
    assert rec.predicted_ffn_utilisation == pytest.approx(1.0)
    assert rec.network_s == pytest.approx(0.0015)
    # round trip at 2A1F: 1.5 ms wire + 1 ms FFN vs 2 ms attention -> S = ceil(1 + 1.25) = 3
    assert rec.micro_batches == 3


def test_recommend_fast_network_needs_two_micro_batches_and_clamps_ratio():
    m = Measured(0.010, 0.0001, 0.0002, (), 1, 10)
    rec = recommend(m, max_servers=8)
    assert rec.ratio == pytest.approx(100)
    assert (rec.attention_servers, rec.ffn_servers) == (8, 1)
    assert rec.micro_batches == 2
    assert not math.isnan(rec.predicted_ffn_utilisation)
