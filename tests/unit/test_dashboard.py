"""deploy/grafana/afd-dashboard.json and deploy/prometheus.yml: valid, and every metric a panel
queries is one afd/metrics.py defines (a renamed metric must not leave an empty panel)."""

import json
import re
from pathlib import Path

import pytest

from afd import metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "afd-dashboard.json"

# PromQL words that are not metric names (functions, aggregations, keywords).
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "clamp_min", "clamp_max", "abs", "time", "vector", "scalar", "topk", "bottomk", "label_replace",
}  # fmt: skip
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: strip strings, label matchers, range
    selectors, grouping clauses and numbers; what is left and not a PromQL word is a metric."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", e)
    words = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e)
    return {w for w in words if w not in PROMQL_WORDS and not re.fullmatch(r"[eE]\d*", w)}


def defined(name: str) -> bool:
    exposed = metrics.exposed_names()
    if name in exposed:
        return True
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and exposed.get(base) == "histogram":
            return True
    return False


def exprs(dash: dict) -> list[tuple[str, str]]:
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def test_metric_name_parser():
    e = (
        "histogram_quantile(0.99, "
        'sum by (peer, le) (rate(afd_x_bucket{a="b,c"}[$__rate_interval])))'
    )
    assert metric_names(e) == {"afd_x_bucket"}
    assert metric_names("sum(rate(a_total[5m])) / sum(rate(b_total[5m])) > 1e-3") == {
        "a_total",
        "b_total",
    }
    assert not defined("afd_no_such_metric") and not defined("afd_prompt_tokens_total_bucket")
    assert defined("afd_ffn_roundtrip_seconds_bucket") and defined("afd_prompt_tokens_total")


def test_dashboard_is_valid_and_every_metric_exists(dashboard):
    assert dashboard["title"] and dashboard["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    queries = exprs(dashboard)
    assert len(queries) >= 20
    used = set()
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        missing = [n for n in names if not defined(n)]
        assert not missing, f"panel {title!r} queries {missing}, not defined in afd/metrics.py"
        used |= {n.removesuffix(s) for n in names for s in HISTOGRAM_SUFFIXES if n.endswith(s)}
        used |= names
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "prometheus"  # the compose datasource's fixed uid
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24
    # What the issue asks the dashboard to show is there.
    for needed in (
        "afd_time_to_first_token_seconds",
        "afd_request_time_per_output_token_seconds",
        "afd_sla_ttft_seconds",
        "afd_sla_tpot_seconds",
        "afd_request_goodput_total",
        "afd_generation_tokens_total",
        "afd_kv_cache_usage_perc",
        "afd_num_requests_waiting",
        "afd_attention_layer_seconds",
        "afd_ffn_roundtrip_part_seconds",
        "afd_ffn_compute_seconds",
        "afd_ffn_straggler",
    ):
        assert needed in used, f"the dashboard does not show {needed}"


def test_prometheus_scrapes_every_service():
    text = (DEPLOY / "prometheus.yml").read_text()
    try:
        import yaml
    except ImportError:  # keep the check without PyYAML: the targets are plain strings
        jobs = re.findall(r"job_name:\s*(\S+)", text)
        targets = re.findall(r'"([\w.-]+:\d+)"', text)
    else:
        doc = yaml.safe_load(text)
        jobs = [j["job_name"] for j in doc["scrape_configs"]]
        targets = [
            t for j in doc["scrape_configs"] for c in j["static_configs"] for t in c["targets"]
        ]
    assert jobs == ["gateway", "attention", "ffn"]
    assert "gateway:8000" in targets
    assert {"attention-0:8080", "attention-1:8080", "ffn-0:8080", "ffn-1:8080"} <= set(targets)
