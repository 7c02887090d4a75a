"""The xAyF planner and the hardware catalog."""

import json

import pytest

from afd.plan.errors import PlanError
from afd.plan.hardware import load_catalog, lookup, lookup_many
from afd.plan.models import PRESETS, resolve_model
from afd.plan.planner import PlanRequest, plan


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_catalog_has_the_papers_chips(catalog):
    h800 = lookup(catalog, "h800")
    assert (h800.price_per_hour, h800.bf16_flops, h800.mem_bandwidth) == (2.0, 9.89e14, 3.35e12)
    assert lookup(catalog, "910B").fp8_flops is None
    assert lookup(catalog, "910b").flops("fp8") == 2.8e14  # no FP8 units: BF16 peak
    assert {h.name for h in lookup_many(catalog, "all")} >= {
        "H800",
        "H20",
        "A800",
        "910B",
        "L20",
        "L4",
    }
    with pytest.raises(PlanError, match="unknown hardware 'B300'.*--hardware-file"):
        lookup(catalog, "B300")


def test_hardware_file_prices_and_adds_chips(tmp_path):
    f = tmp_path / "hw.json"
    f.write_text(json.dumps({
        "l20": {"price_per_hour": 0.5},
        "X1": {"bf16_flops": 1e15, "mem_bandwidth": 5e12, "mem_gib": 141, "price_per_hour": 3},
    }))  # fmt: skip
    cat = load_catalog(f)
    assert lookup(cat, "L20").price_per_hour == 0.5
    assert lookup(cat, "L20").mem_bandwidth == 8.64e11  # other fields kept
    assert lookup(cat, "x1").mem_gib == 141


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"X2": {"bf16_flops": 1e15, "mem_gib": 80}}', "missing required field 'mem_bandwidth'"),
        ('{"H800": {"price_per_hour": -1}}', "H800.price_per_hour must be positive"),
        ('{"H800": {"prize": 1}}', "unknown field"),
        ("[1, 2]", "JSON object"),
        ("{not json", "not readable JSON"),
    ],
)
def test_bad_hardware_file(tmp_path, content, match):
    f = tmp_path / "hw.json"
    f.write_text(content)
    with pytest.raises(PlanError, match=match):
        load_catalog(f)


def test_plan_ranks_by_cost_and_meets_sla(catalog):
    p = plan(PlanRequest(PRESETS["step3"], context=4096), catalog)
    assert p.layer_budget_s == pytest.approx(0.05 / 61 / 3)
    costs = [c.dollars_per_hour for c in p.feasible]
    assert costs == sorted(costs) and len(p.feasible) > 10
    for c in p.feasible:
        assert c.tpot_s <= 0.05 and c.batch_per_chip >= 1
        assert c.replicas * c.unit_tps >= 100_000
        assert c.chips == c.replicas * 8 * (c.x + c.y)
    best = p.feasible[0]
    # the cost model's verdict carries over: cheap bandwidth for attention, FLOPs for the FFN
    assert best.attention_hw == "H20" and best.ffn_hw == "H800"


def test_rejections_name_memory_latency_network_and_price(catalog):
    p = plan(
        PlanRequest(
            PRESETS["deepseek-v3"],
            attention_hw=("H800", "L4"),
            ffn_hw=("H800", "L20"),
            max_attention=2,
            max_ffn=2,
        ),
        catalog,
    )
    kinds = {c.rejected for c in p.rejected}
    assert {"memory", "price"} <= kinds
    mem = next(c for c in p.rejected if c.rejected == "memory" and c.ffn_hw == "H800")
    assert "FFN weights over 8 H800 chips" in mem.reason  # 671B params do not fit on one node
    assert all(c.y == 2 for c in p.feasible)
    slow_net = plan(PlanRequest(PRESETS["step3"], network_gbps=0.5, max_ffn=2), catalog)
    assert slow_net.rejection_counts().get("network", 0) > 0
    tight = plan(PlanRequest(PRESETS["step3"], tpot_s=0.012), catalog)
    lat = [c for c in tight.rejected if c.rejected == "latency"]
    assert lat and "at 1 sequence per chip" in lat[0].reason


def test_impossible_sla_and_bad_request_raise_clear_errors(catalog):
    with pytest.raises(PlanError, match="no deployment of step3 meets TPOT 1 ms.*latency"):
        plan(PlanRequest(PRESETS["step3"], tpot_s=0.001), catalog)
    with pytest.raises(PlanError, match="TPOT SLA must be positive"):
        PlanRequest(PRESETS["step3"], tpot_s=0)
    with pytest.raises(PlanError, match="unknown hardware"):
        plan(PlanRequest(PRESETS["step3"], ffn_hw=("nope",)), catalog)


def test_more_micro_batches_shrink_the_per_layer_budget(catalog):
    m = PRESETS["qwen3-30b-a3b"]
    two = plan(PlanRequest(m, micro_batches=2, max_attention=2, max_ffn=2), catalog)
    three = plan(PlanRequest(m, micro_batches=3, max_attention=2, max_ffn=2), catalog)
    assert three.layer_budget_s < two.layer_budget_s


def test_resolve_model(tmp_path):
    assert resolve_model("DSv3") is PRESETS["deepseek-v3"]
    with pytest.raises(PlanError, match="unknown model 'gpt-9'"):
        resolve_model("gpt-9")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(Exception, match="missing required field"):
        resolve_model(str(tmp_path))
