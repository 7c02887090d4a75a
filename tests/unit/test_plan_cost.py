"""The Step-3 paper's cost model: Table 6 at 8K context and the arithmetic behind it."""

import pytest

from afd.config import ModelConfig
from afd.plan.arithmetic import arithmetic_intensity, moe_sparsity, param_counts, token_arith
from afd.plan.cost import (
    CostAssumptions,
    cost_table,
    ffn_batch_for_utilisation,
    layer_traffic,
    min_ffn_chips_for_sparsity,
    min_moe_sparsity,
    roofline_tokens_per_expert,
    servers_per_token,
)
from afd.plan.errors import PlanError
from afd.plan.hardware import load_catalog, lookup_many
from afd.plan.models import PRESETS, from_model_config

CHIPS = ("H800", "H20", "A800", "910B")
# Paper Table 6, USD per 1M tokens at 8K context: (attention, FFN) per chip.
TABLE6 = {
    "step3": ((0.048, 0.040, 0.040, 0.043), (0.015, 0.040, 0.036, 0.035)),
    "deepseek-v3": ((0.054, 0.128, 0.114, 0.113), (0.014, 0.036, 0.032, 0.032)),
    "qwen3-235b-a22b": ((0.135, 0.054, 0.091, 0.101), (0.008, 0.021, 0.019, 0.019)),
}
BEST = {"step3": 0.055, "deepseek-v3": 0.068, "qwen3-235b-a22b": 0.062}


@pytest.fixture(scope="module")
def chips():
    return lookup_many(load_catalog(), list(CHIPS))


def _table(name, chips, **kw):
    return cost_table(PRESETS[name], chips, 8192, CostAssumptions(**kw))


@pytest.mark.parametrize("name", list(TABLE6))
@pytest.mark.parametrize("i", range(4), ids=CHIPS)
def test_table6_within_5_percent(name, i, chips):
    row = _table(name, chips).rows[i]
    attn, ffn = TABLE6[name][0][i], TABLE6[name][1][i]
    assert row.hardware == CHIPS[i]
    assert row.attention == pytest.approx(attn, rel=0.05)
    assert row.ffn == pytest.approx(ffn, rel=0.05)


@pytest.mark.parametrize("name", list(BEST))
def test_best_afd_totals(name, chips):
    c = _table(name, chips)
    assert c.best_afd_total == pytest.approx(BEST[name], rel=0.05)
    assert c.best_ffn == "H800"  # FFN is compute-bound: the most FLOP/s per dollar wins
    assert c.best_afd_total <= c.best_non_afd_total


def test_step3_is_cheapest_and_afd_pays_off(chips):
    totals = {n: _table(n, chips).best_afd_total for n in BEST}
    assert min(totals, key=totals.get) == "step3"
    step3 = _table("step3", chips)
    assert step3.best_attention == "H20" and step3.afd_saving > 0.1


def test_chips_without_fp8_are_costed_at_bf16(chips):
    rows = {r.hardware: r for r in _table("step3", chips).rows}
    assert rows["H800"].compute_dtype == "fp8" and rows["A800"].compute_dtype == "bf16"
    bf16 = {r.hardware: r for r in _table("step3", chips, compute_dtype="bf16").rows}
    assert bf16["H800"].ffn == pytest.approx(2 * rows["H800"].ffn, rel=1e-3)
    assert bf16["A800"].ffn == pytest.approx(rows["A800"].ffn)


def test_bf16_kv_doubles_kv_cost_and_mfu_scales_flops(chips):
    fp8 = _table("qwen3-235b-a22b", chips).rows[0]
    bf16 = _table("qwen3-235b-a22b", chips, kv_dtype="bf16").rows[0]
    assert bf16.kv_access == pytest.approx(2 * fp8.kv_access)
    half = _table("qwen3-235b-a22b", chips, mfu=0.5).rows[0]
    assert half.ffn == pytest.approx(2 * fp8.ffn)


@pytest.mark.parametrize(
    "name,activated,total",
    [
        ("step3", 38e9, 321e9),  # 321B includes the ~5B vision encoder the text model lacks
        ("deepseek-v3", 37e9, 671e9),
        ("qwen3-235b-a22b", 22e9, 235e9),
        ("qwen3-30b-a3b", 3.3e9, 30.5e9),
        ("mixtral-8x7b", 12.9e9, 46.7e9),
    ],
)
def test_params_match_public_figures(name, activated, total):
    p = param_counts(PRESETS[name])
    assert p.activated == pytest.approx(activated, rel=0.03)
    assert p.total == pytest.approx(total, rel=0.03)


def test_arithmetic_intensity_with_8bit_kv():
    assert arithmetic_intensity(PRESETS["step3"]) == 128
    assert arithmetic_intensity(PRESETS["deepseek-v3"]) == 512
    assert arithmetic_intensity(PRESETS["qwen3-235b-a22b"]) == 32
    assert arithmetic_intensity(PRESETS["step3"], "bf16") == 64


def test_kv_bytes_and_flops_scale_with_context():
    m = PRESETS["step3"]
    t4, t8 = token_arith(m, 4096), token_arith(m, 8192)
    assert t8.kv_bytes == 2 * t4.kv_bytes == 61 * 8192 * 512
    assert t8.attn_core_flops == 2 * t4.attn_core_flops
    assert t8.attn_linear_flops == t4.attn_linear_flops  # projections do not depend on L
    assert t8.attn_intensity == 128
    with pytest.raises(PlanError, match="context"):
        token_arith(m, 0)


def test_sparse_attention_reads_topk_rows_past_its_topk():
    """DeepSeek-V3.2: up to index_topk tokens it costs V3's attention plus its indexer; past
    it, the latent rows read stay at index_topk and only the indexer's keys grow."""
    v3, v32 = PRESETS["deepseek-v3"], PRESETS["deepseek-v3.2"]
    indexer_flops = 61 * 2 * 64 * (128 + 1)  # per position: q.k over 64 heads, then weights
    for ctx in (1024, 2048):
        a, b = token_arith(v3, ctx), token_arith(v32, ctx)
        assert b.attn_core_flops == a.attn_core_flops + ctx * indexer_flops
        assert b.kv_bytes == a.kv_bytes + 61 * ctx * 128
    a, b = token_arith(v32, 16384), token_arith(v32, 131072)
    assert b.kv_bytes - a.kv_bytes == 61 * (131072 - 16384) * 128  # indexer keys only
    assert token_arith(v32, 131072).attn_core_flops < token_arith(v3, 131072).attn_core_flops / 4
    assert b.attn_linear_flops > token_arith(v3, 8192).attn_linear_flops  # the indexer's weights
    assert arithmetic_intensity(v32, context=2048) < 512  # its indexer reads every key


def test_ffn_flops_split_routed_shared_dense():
    t = token_arith(PRESETS["step3"], 8192)
    expert = 3 * 7168 * 5120
    assert t.ffn_routed_flops == 2 * 56 * 3 * expert
    assert t.ffn_shared_flops == 2 * 56 * expert
    assert t.ffn_dense_flops == 2 * 5 * 3 * 7168 * 18432


def test_from_model_config_matches_preset():
    raw = {
        "model_type": "step3_text", "vocab_size": 128815, "hidden_size": 7168,
        "num_hidden_layers": 61, "num_attention_heads": 64, "head_dim": 256,
        "num_attention_groups": 1, "share_q_dim": 2048, "max_position_embedding": 65536,
        "moe_num_experts": 48, "moe_top_k": 3, "moe_intermediate_size": 5120,
        "intermediate_size": 18432, "share_expert_dim": 5120,
        "moe_layers_enum": ",".join(str(i) for i in range(4, 60)),
    }  # fmt: skip
    m = from_model_config(ModelConfig.from_dict(raw), name="step3")
    assert param_counts(m) == param_counts(PRESETS["step3"])
    assert token_arith(m, 8192) == token_arith(PRESETS["step3"], 8192)


def test_sparsity_and_ffn_sizing():
    cat = load_catalog()
    h800, h20 = cat["H800"], cat["H20"]
    assert moe_sparsity(PRESETS["step3"]) == pytest.approx(4 / 49)
    assert moe_sparsity(PRESETS["deepseek-v3"]) == pytest.approx(9 / 257)
    # roofline: FP8 FLOP/s per weight byte / 2 FLOPs per token
    assert roofline_tokens_per_expert(h800) == pytest.approx(1.979e15 / 3.35e12 / 2)
    assert ffn_batch_for_utilisation(PRESETS["step3"], h800, 1.0) == pytest.approx(
        295.4 * 48 / 3, rel=0.01
    )
    budget = 0.05 / 61 / 3
    hi, lo = (
        min_moe_sparsity(PRESETS["step3"], h800, budget),
        min_moe_sparsity(PRESETS["step3"], h20, budget),
    )
    assert hi.min_sparsity > lo.min_sparsity  # compute-rich chips need denser MoE
    assert min_moe_sparsity(PRESETS["step3"], h800, budget, 800).min_sparsity == pytest.approx(
        hi.min_sparsity / 2
    )
    # the sparser the model, the more expert-parallel chips an FFN needs
    need = {n: min_ffn_chips_for_sparsity(PRESETS[n], hi.min_sparsity) for n in BEST}
    assert need["deepseek-v3"] > need["step3"] >= 1


def test_layer_traffic():
    m = PRESETS["step3"]
    assert servers_per_token(m, 1) == 1.0
    assert 1 < servers_per_token(m, 4) <= 4
    t = layer_traffic(m, 128, 1)
    assert t.a2f_bytes == 128 * (7168 + 4 + 8 * 3)  # fp8 hidden + scale + ids/weights
    assert t.f2a_bytes == 128 * 7168 * 2


def test_deepseek_checkpoints_cost_as_their_attention_kind(tmp_path):
    from tests.helpers.checkpoints import deepseek_v3, deepseek_v32

    m3 = from_model_config(ModelConfig.from_hf(deepseek_v3(tmp_path / "v3")))
    m32 = from_model_config(ModelConfig.from_hf(deepseek_v32(tmp_path / "v32")))
    assert (m3.attention, m3.kv_lora_rank, m3.qk_rope_dim, m3.q_lora_rank) == ("mla", 32, 8, 48)
    assert (m32.attention, m32.index_topk, m32.index_head_dim) == ("dsa", 8, 16)
    assert token_arith(m32, 64).kv_bytes == 3 * (8 * 40 + 64 * 16)
