"""`afd plan` as a command: JSON for machines, `error: ...` and status 2 for bad input."""

import argparse
import json

import pytest

from afd.plan.cli import add_parser, main, run

# attention 2 ms per layer, FFN 0.5 ms per call on each of 2 peers, round trip 2 ms
ATTENTION = """afd_attention_layer_seconds_sum 0.2
afd_attention_layer_seconds_count 100
afd_ffn_roundtrip_seconds_sum{peer="ffn0"} 0.1
afd_ffn_roundtrip_seconds_count{peer="ffn0"} 100
afd_ffn_roundtrip_seconds_sum{peer="ffn1"} 0.3
afd_ffn_roundtrip_seconds_count{peer="ffn1"} 100
"""
FFN = """afd_ffn_compute_seconds_sum 0.1
afd_ffn_compute_seconds_count 200
"""


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_add_parser_registers_plan():
    parser = argparse.ArgumentParser(prog="afd")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["plan", "cost", "--model", "step3", "--json"])
    assert args.command == "plan" and args.action == "cost" and args.json
    assert callable(run)


def test_cost_json_reproduces_best_totals(capsys):
    rc, out, _ = _run(capsys, "cost", "--json")
    assert rc == 0
    data = json.loads(out)
    best = {c["model"]: c["best_afd"]["total"] for c in data["costs"]}
    assert best["step3"] == pytest.approx(0.055, rel=0.05)
    assert best["deepseek-v3"] == pytest.approx(0.068, rel=0.05)
    assert best["qwen3-235b-a22b"] == pytest.approx(0.062, rel=0.05)


def test_cost_table_for_people(capsys):
    rc, out, _ = _run(capsys, "cost", "--model", "step3", "--context", "8192")
    assert rc == 0
    assert "best AFD: attention on H20" in out and "FFN on H800" in out


def test_deploy_json_parses_and_is_ranked(capsys):
    rc, out, _ = _run(capsys, "--model", "qwen3-30b-a3b", "--max-instances", "2", "--json")
    assert rc == 0
    data = json.loads(out)
    costs = [d["dollars_per_hour"] for d in data["deployments"]]
    assert costs == sorted(costs) and data["layer_budget_s"] > 0


def test_deploy_table_shows_rejections(capsys):
    rc, out, _ = _run(capsys, "deploy", "--model", "dsv3", "--max-instances", "2")
    assert rc == 0
    assert "rejected" in out and "memory" in out


def test_from_metrics_files(tmp_path, capsys):
    a, f = tmp_path / "attention.prom", tmp_path / "ffn.prom"
    a.write_text(ATTENTION)
    f.write_text(FFN)
    rc, out, _ = _run(capsys, "--from-metrics", str(a), "--from-metrics", f.as_uri(), "--json")
    assert rc == 0
    rec = json.loads(out)["recommendation"]
    assert (rec["attention_servers"], rec["ffn_servers"], rec["micro_batches"]) == (2, 1, 3)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["cost", "--hardware", "H900"], "unknown hardware 'H900'"),
        (["--attention-hw", "TPU9"], "unknown hardware 'TPU9'"),
        (["--tpot-ms", "1"], "no deployment of step3 meets TPOT 1 ms"),
        (["--tpot-ms", "-5"], "TPOT SLA must be positive"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["cost", "--context", "0"], "context length must be at least 1"),
        (["cost", "--kv-dtype", "fp4"], "unknown dtype 'fp4'"),
        (["cost", "--hardware", "L4"], "has a price"),
        (["--hardware-file", "/no/such.json"], "does not exist"),
        (["--from-metrics", "/no/such.prom"], "neither a URL nor an existing file"),
        (["--from-metrics", "http://127.0.0.1:9/metrics"], "cannot read metrics"),
    ],
)
def test_bad_input_prints_error_and_returns_2(capsys, argv, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_config_missing_fields_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "step3_text"}))
    rc, _, err = _run(capsys, "cost", "--model", str(tmp_path))
    assert rc == 2 and "missing required field" in err
