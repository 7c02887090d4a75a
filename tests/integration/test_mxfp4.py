"""MXFP4 experts (gpt-oss's released format) kept in 4 bits: greedy tokens identical to
transformers on a checkpoint in the released layout (which transformers dequantizes on load),
on both compute paths (direct: afd's kernel reads the 4-bit weights; workspace: experts
converted on use into a shared LRU pool), in float32, and in bf16 on every kernel path the same
tokens as the dequantized numbers served dense; a workspace smaller than one layer's experts
changes nothing but its hit rate; the weights stay 4.25 bits; planted bugs in the format, the
attention sinks and the sliding window are caught."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from afd import metrics
from afd import mxfp4 as mxfp4_mod
from afd.config import ExpertConfig, ModelConfig
from afd.errors import CheckpointError
from afd.kernels import mxfp4 as native
from afd.mxfp4 import MXFP4
from afd.sharding import ExpertShard
from services.ffn.engine import FFNEngine
from tests.helpers.checkpoints import (
    gpt_oss,
    gpt_oss_mxfp4,
    hf_greedy,
    hf_model,
    mxfp4_dequantize,
    mxfp4_quantize,
)
from tests.integration.test_engine_reference import NEW, PROMPTS, afd_greedy, engine_cfg

COMPUTE = ["direct", "workspace"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the MXFP4 checkpoint, its float32 transformers model, that model's greedy tokens)."""
    base = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    mx, _ = gpt_oss_mxfp4(gpt_oss(base / "src"), base)
    model = hf_model(mx, torch.float32)  # dequantized by transformers on load
    return mx, model, hf_greedy(model, PROMPTS, NEW)


def cfg_for(path, compute: str, workspace_mb: float = 1024.0, **kw):
    cfg = engine_cfg(path, **kw)
    return replace(cfg, experts=ExpertConfig(compute=compute, workspace_mb=workspace_mb))


@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("S", [1, 2])
def test_tokens_identical_to_transformers(ckpt, compute, S):
    path, _, ref = ckpt
    assert ModelConfig.from_hf(path).mxfp4_experts
    assert afd_greedy(cfg_for(path, compute, S=S))[0] == ref


@pytest.mark.parametrize("compute", COMPUTE)
def test_bf16_tokens_identical_to_the_same_numbers_dense(ckpt, compute, kernel_path):
    """bf16 on every kernel path (the direct kernel runs on afd's paths, torch elsewhere): the
    same tokens as the dequantized weights served as a dense checkpoint. (How close afd's bf16
    stays to transformers is the bf16 reference tests' business: test_engine_reference.py.)"""
    path, _, _ = ckpt
    dense = path.parent / "dense"
    want = afd_greedy(engine_cfg(dense, dtype="bfloat16", S=2))[0]
    assert afd_greedy(cfg_for(path, compute, dtype="bfloat16", S=2))[0] == want


def _counts() -> tuple[float, float, float]:
    lookups = metrics.WORKSPACE_LOOKUPS
    return (
        lookups.labels("hit")._value.get(),
        lookups.labels("miss")._value.get(),
        metrics.WORKSPACE_EVICTIONS._value.get(),
    )


def test_a_workspace_smaller_than_one_layer_gives_the_same_tokens(ckpt):
    """0.1 MiB holds two of this model's float32 experts (48 KiB each): a layer has eight."""
    path, _, ref = ckpt
    cfg = ModelConfig.from_hf(path)
    expert_bytes = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    assert 0.1 * (1 << 20) < cfg.num_experts * expert_bytes
    hits, misses, evictions = _counts()
    assert afd_greedy(cfg_for(path, "workspace", workspace_mb=0.1, S=2))[0] == ref
    h, m, e = (a - b for a, b in zip(_counts(), (hits, misses, evictions), strict=True))
    assert m > 0 and e > 0 and h > 0, (h, m, e)
    # with room for every expert, each is converted once and then always hit
    hits, misses, _ = _counts()
    assert afd_greedy(cfg_for(path, "workspace", S=2))[0] == ref
    h, m, _ = (a - b for a, b in zip(_counts(), (hits, misses, 0), strict=True))
    assert m <= cfg.num_layers * cfg.num_experts and h > 10 * m


def test_experts_stay_in_four_bits(ckpt):
    path, _, _ = ckpt
    cfg = ModelConfig.from_hf(path)
    for compute in COMPUTE:
        ffn = FFNEngine(
            cfg,
            ExpertShard(0, 1, cfg.num_experts),
            torch.bfloat16,
            progress=False,
            experts=ExpertConfig(compute=compute),
        )
        lins = [*ffn.experts[0].w13, *ffn.experts[2].w2]
        assert all(isinstance(lin.w, MXFP4) for lin in lins)
        for lin in lins:  # half a byte a weight and a byte per 32: 4.25 bits
            N, K = lin.out_features, lin.in_features
            assert lin.w.nbytes == N * K // 2 + N * K // 32


# K: the AVX-512 route reads blocks four at a time; 1, 2, 3 and no blocks left over
@pytest.mark.parametrize("K", [96, 160, 224, 256])
def test_the_native_kernels_match_the_dequantized_weights(kernel_path, K):
    torch.manual_seed(0)
    w = torch.randn(72, K)
    blocks, scales = mxfp4_quantize(w)
    m = MXFP4.from_checkpoint(blocks, scales)
    dense = mxfp4_dequantize(blocks, scales)
    assert torch.equal(m.dequantize(torch.float32), dense)
    assert torch.equal(m.dequantize(torch.bfloat16), dense.bfloat16())
    for rows in (1, 2, 3, 5, 9, 17):
        x = torch.randn(rows, K)
        torch.testing.assert_close(m.linear(x), x @ dense.T, rtol=1e-5, atol=1e-4)
        xb = x.bfloat16()
        ref = (xb.float() @ dense.T).bfloat16()  # one rounding of the fp32 sum
        torch.testing.assert_close(m.linear(xb), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("K", [96, 256])
def test_scale_bytes_outside_the_scaled_tables_take_the_plain_route(kernel_path, K):
    """AVX2's route looks codes up in tables already scaled for scale bytes 2..252 (float32 x
    takes it on every native path); a row with a byte outside them (0, 1: weights below fp32's
    normal range, here whole rows; 253: near its top, one block a row) is multiplied by the
    scale instead. Tables used for such a block would give zeros."""
    g = torch.Generator().manual_seed(1)
    N, G = 24, K // 32
    blocks = torch.randint(0, 256, (N, G, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (N, G), dtype=torch.uint8, generator=g)
    scales[0:4], scales[4:8], scales[8:12, G // 2] = 0, 1, 253
    blocks[8:12] &= 0xBB  # magnitudes up to 1.5 where the scale is 2^126: fp32 holds them
    m = MXFP4.from_checkpoint(blocks, scales)
    dense = mxfp4_dequantize(blocks, scales).double()
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, K, generator=g)
        for sel, xs in ((slice(0, 8), x), (slice(8, 24), x * 2.0**-16)):
            got = m.linear(xs)[:, sel].double()
            want = xs.double() @ dense[sel].T
            size = xs.double().abs() @ dense[sel].abs().T  # fp32 sums err relative to this
            assert (size > 0).all()
            assert ((got - want).abs() <= 1e-6 * size).all(), (got - want).abs().max()


def test_the_amx_route_sums_what_the_dense_amx_matmul_sums():
    """On AMX (from 2 rows of x: one row takes the AVX-512 route) a block's scale is folded
    into its bf16 values (exact for scale bytes 2..252), so the MXFP4 matmul sums what the dense
    AMX matmul sums for the dequantized weight, in its order: the same bits, for one and two
    blocks of 16 rows of x and an odd block after pairs, with a block of zeros (scale byte 0,
    as the quantizer writes it) among them. A weight with a scale outside that range on a
    nonzero block is not foldable and takes the AVX-512 route, which still computes the
    product."""
    from afd.kernels import gemm, paths

    if "amx" not in paths.runnable():
        pytest.skip("needs AMX (Intel Sapphire Rapids and later)")
    torch.manual_seed(3)
    blocks, scales = mxfp4_quantize(torch.randn(96, 160))  # 6 tiles of rows, G = 5
    blocks[7, 1], scales[7, 1] = 0, 0  # a block of zeros, as afd quantize writes one
    m = MXFP4.from_checkpoint(blocks, scales)
    assert m.foldable
    dense = gemm.lay_out(m.dequantize(torch.bfloat16), "amx")  # the dense matmul's tiles
    with paths.use("amx"):
        for rows in (2, 5, 17, 32, 70):
            x = torch.randn(rows, 160).bfloat16()
            assert torch.equal(m.linear(x), gemm.bf16_linear(x, dense, "amx")), rows
        scales = m.scales.clone()
        scales[3, 2] = 1
        odd = MXFP4.from_checkpoint(m.blocks, scales)
        assert not odd.foldable
        want = (x.float() @ odd.dequantize(torch.float32).T).bfloat16()
        torch.testing.assert_close(odd.linear(x), want, rtol=1e-2, atol=1e-2)


def test_afd_quantizer_matches_the_format():
    """afd's writer (afd quantize --mxfp4): the independent test quantizer's codes where no
    value is a tie, ties to the even code, scales that fit each block's largest magnitude."""
    torch.manual_seed(1)
    w = torch.randn(16, 64) * torch.logspace(-3, 3, 16).unsqueeze(1)
    ours, theirs = mxfp4_mod.quantize(w), mxfp4_quantize(w)
    assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[0], theirs[0])
    # ties: 0.25 (between 0 and 0.5) and 5 (between 4 and 6) go to the even codes 0 and 6
    tie = torch.tensor([[6.0, 0.25, 5.0, -5.0] + [0.0] * 28])
    deq = mxfp4_dequantize(*mxfp4_mod.quantize(tie))
    assert deq[0, :4].tolist() == [6.0, 0.0, 4.0, -4.0]


def test_blocks_without_scales_are_a_checkpoint_error(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _ = ckpt
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(broken)
    with pytest.raises(CheckpointError, match="down_proj_blocks.* has no .*down_proj_scales"):
        FFNEngine(cfg, ExpertShard(0, 1, cfg.num_experts), torch.float32, progress=False)


@pytest.mark.parametrize("compute", COMPUTE)
def test_planted_swapped_nibble_order_is_caught(ckpt, monkeypatch, compute):
    path, _, ref = ckpt
    real = MXFP4.from_checkpoint

    def swapped(blocks, scales):  # the odd element read from the low nibble
        return real(((blocks & 15) << 4) | (blocks >> 4), scales)

    monkeypatch.setattr(mxfp4_mod.MXFP4, "from_checkpoint", staticmethod(swapped))
    assert afd_greedy(cfg_for(path, compute, S=1))[0] != ref


@pytest.mark.parametrize("compute", COMPUTE)
def test_planted_scale_off_by_one_is_caught(ckpt, monkeypatch, compute):
    path, _, ref = ckpt
    real = MXFP4.from_checkpoint

    def doubled(blocks, scales):  # every block read at twice its scale
        return real(blocks, scales + 1)

    monkeypatch.setattr(mxfp4_mod.MXFP4, "from_checkpoint", staticmethod(doubled))
    assert afd_greedy(cfg_for(path, compute, S=1))[0] != ref


def test_planted_sink_dropped_is_caught(ckpt, monkeypatch):
    from services.attention import paged_attention as pa

    path, _, ref = ckpt
    real = pa._attend
    monkeypatch.setattr(pa, "_attend", lambda *a, **kw: real(*a[:6]))  # no sinks
    assert afd_greedy(cfg_for(path, "direct", S=1))[0] != ref


def test_planted_sliding_window_ignored_is_caught(ckpt, monkeypatch):
    from services.attention import paged_attention as pa

    path, _, ref = ckpt
    monkeypatch.setattr(pa, "_windowed", lambda bias, positions, window: bias)
    assert afd_greedy(cfg_for(path, "direct", S=1))[0] != ref


def test_the_direct_path_reads_four_bits_on_afds_paths(monkeypatch, kernel_path):
    """The direct path multiplies with afd's kernel (the 4-bit codes as they are) where afd's
    kernels run, and through a dequantized copy on the others (AFD_KERNELS=onednn|torch): the
    greedy tests above run both."""
    from afd.kernels import paths

    calls = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(2)
    m = MXFP4.from_checkpoint(*mxfp4_quantize(torch.randn(8, 64)))
    x = torch.randn(3, 64).bfloat16()
    want = (x.float() @ m.dequantize(torch.float32).T).bfloat16()
    torch.testing.assert_close(m.linear(x), want, rtol=1e-2, atol=1e-2)
    assert bool(calls) == paths.active().native


def _dense_copy(quantized, out):
    """The numbers an MXFP4 checkpoint holds, as a dense checkpoint transformers loads
    (dequantized by the test's own decoder)."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(quantized / "model.safetensors"))
    dense = {}
    for k, v in t.items():
        if k.endswith("_blocks"):
            name = k.removesuffix("_blocks")
            dense[name] = mxfp4_dequantize(v, t[name + "_scales"])
        elif not k.endswith("_scales"):
            dense[k] = v
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((quantized / "config.json").read_text())
    raw.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(raw))
    return out


# Teacher-forced logits of the tiny random qwen3_moe (logit std ~1.6) with its experts in MXFP4,
# against the same model in float32, on the test prompts plus a 64-token one (128 positions).
# Measured: max |dlogit| 3.59, mean 0.247, top-1 agreement 65%; random Gaussian weights are
# MXFP4's worst case (no outliers for the shared scale to absorb, 4-bit steps on every value).
LOGIT_BOUND = {"max": 4.5, "mean": 0.32, "top1": 0.55}


def test_afd_quantize_mxfp4_on_qwen3_moe(tmp_path):
    from afd_cli.main import main
    from tests.helpers.checkpoints import hf_logits, qwen3_moe

    src = qwen3_moe(tmp_path / "src")
    q = tmp_path / "q"
    assert main(["quantize", "--mxfp4", str(src), str(q)]) == 0
    cfg = ModelConfig.from_hf(q)
    assert cfg.mxfp4_experts
    ffn = FFNEngine(cfg, ExpertShard(0, 1, cfg.num_experts), torch.float32, progress=False)
    assert isinstance(ffn.experts[0].w13[0].w, MXFP4)
    assert not isinstance(ffn.dense[1].w13.w, MXFP4)  # only routed experts are quantized
    dense = _dense_copy(q, tmp_path / "dense")
    theirs = hf_model(dense, torch.float32)
    for compute in COMPUTE:
        assert afd_greedy(cfg_for(q, compute, S=2))[0] == hf_greedy(theirs, PROMPTS, NEW)
    base = hf_model(src, torch.float32)
    worst, means, agree = 0.0, [], []
    for p in [*PROMPTS, list(range(200, 264))]:
        a, b = hf_logits(base, p), hf_logits(theirs, p)
        d = (a - b).abs()
        worst, means = max(worst, d.max().item()), [*means, d.mean().item()]
        agree += (a.argmax(-1) == b.argmax(-1)).tolist()
    assert worst <= LOGIT_BOUND["max"]
    assert sum(means) / len(means) <= LOGIT_BOUND["mean"]
    assert sum(agree) / len(agree) >= LOGIT_BOUND["top1"]
    assert main(["quantize", "--mxfp4", str(src), str(q)]) == 2  # dst exists: refused


def test_afd_quantize_mxfp4_writes_gpt_oss_released_layout(ckpt, tmp_path):
    """From gpt-oss's bf16 layout ([E, in, out] stacks), afd writes the released MXFP4 one
    byte for byte as the test's own writer does, which transformers loads."""
    from safetensors.torch import load_file

    from afd_cli.main import main

    path, _, ref = ckpt
    src = path.parent / "src"
    mine = tmp_path / "mine"
    assert main(["quantize", "--mxfp4", str(src), str(mine)]) == 0
    theirs, ours = (load_file(str(d / "model.safetensors")) for d in (path, mine))
    assert theirs.keys() == ours.keys()
    for k, t in theirs.items():
        assert torch.equal(t, ours[k]), k
    assert hf_greedy(hf_model(mine, torch.float32), PROMPTS, NEW) == ref


def test_afd_quantize_mxfp4_refuses_rows_not_in_blocks_of_32(tmp_path):
    from afd_cli.main import main
    from tests.helpers.checkpoints import qwen3_moe

    src = qwen3_moe(tmp_path / "src", moe_intermediate_size=24)  # down_proj rows of 24
    assert main(["quantize", "--mxfp4", str(src), str(tmp_path / "q")]) == 2
    assert not (tmp_path / "q").exists()
