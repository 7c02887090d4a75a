"""Block-FP8 checkpoints (DeepSeek's format) kept in FP8: greedy tokens identical to the same
numbers served dense, for every family with a transformers reference, in float32 and on every
bf16 kernel path; the weights stay one byte each in both services; malformed scales are a
clear error."""

from __future__ import annotations

import inspect
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from afd import blockfp8
from afd.blockfp8 import FP8, BlockFP8
from afd.config import ModelConfig
from afd.errors import CheckpointError, ConfigError
from afd.ops import Linear
from afd.sharding import ExpertShard
from services.attention.model import AttentionModel
from services.ffn.engine import FFNEngine
from tests.helpers import checkpoints
from tests.helpers.checkpoints import (
    MLA_FUSED_DIMS,
    REFERENCE_CHECKPOINTS,
    block_fp8_pair,
    deepseek_v3,
    deepseek_v32,
)
from tests.integration.test_engine_reference import afd_greedy, engine_cfg

# gpt-oss: its attention (biases, sinks) in FP8; its stacked experts stay bf16 in this writer's copy
FAMILIES = ["deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss"]
# K = 64 and N in 32..384 in these checkpoints: 32 x 48 blocks leave partial blocks both ways
BLOCK = (32, 48)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        base = tmp_path_factory.mktemp(f"fp8-{family}")
        src = REFERENCE_CHECKPOINTS[family](base / "src")
        out[family] = block_fp8_pair(src, base, BLOCK)
    # DeepSeek in sizes MLA's fused layer takes (the reference checkpoint's rotary width is
    # not), and V3.2's sparse attention (8 rows kept a query) in the same sizes
    base = tmp_path_factory.mktemp("fp8-deepseek-fused")
    src = deepseek_v3(base / "src", **MLA_FUSED_DIMS)
    out["deepseek_v3_fused"] = block_fp8_pair(src, base, BLOCK)
    base = tmp_path_factory.mktemp("fp8-dsa-fused")
    src = deepseek_v32(base / "src", index_head_dim=32, **MLA_FUSED_DIMS)
    out["deepseek_v32_fused"] = block_fp8_pair(src, base, BLOCK)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_tokens_identical_to_the_same_numbers_dense(pairs, family):
    fp8, dense = pairs[family]
    assert ModelConfig.from_hf(fp8).weight_block == BLOCK
    assert afd_greedy(engine_cfg(fp8, S=2))[0] == afd_greedy(engine_cfg(dense, S=2))[0]


def test_fp8_bf16_tokens_identical_on_every_kernel_path(pairs, kernel_path, tmp_path):
    fp8, dense = pairs["deepseek_v3"]
    got = afd_greedy(engine_cfg(fp8, dtype="bfloat16", S=2))[0]
    assert got == afd_greedy(engine_cfg(dense, dtype="bfloat16", S=2))[0]


def _stack_builds(monkeypatch) -> list:
    """The decode stacks built from here on: per layer the K-block its attention, routed
    experts and shared expert (or dense MLP) were given in the call's structs (0: bf16; None:
    the layer has none)."""
    from afd.kernels.decode_stack import NativeDecodeStack

    built = []
    real = NativeDecodeStack.__init__

    def spy(stack, parts):
        real(stack, parts)
        rows = []
        for s, p in zip(stack._layers, parts, strict=True):
            attn = p.attention.layer.bk if s.mla else s.attn_bk
            assert attn == p.attention.block_k
            experts = s.experts_bk if p.experts is not None else None
            rows.append((attn, experts, s.shared_bk if p.shared is not None else None))
        built.append(rows)

    monkeypatch.setattr(NativeDecodeStack, "__init__", spy)
    return built


def _blocks(built: list) -> set:
    return {bk for layers in built for row in layers for bk in row if bk is not None}


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "mixtral", "deepseek_v3_fused", "deepseek_v32_fused"]
)
def test_fp8_in_native_calls_gives_the_dense_tokens(pairs, family, native_path, monkeypatch):
    """bf16 on afd's paths: the FP8 model's steps in the decode stack (its projections in the
    fused layer, GQA's or MLA's, its experts in the fused call, DeepSeek's shared expert and
    dense MLP in theirs: codes and scales passed through), the dense twin's too: the same
    tokens."""
    fp8, dense = pairs[family]
    model = AttentionModel(ModelConfig.from_hf(fp8), torch.bfloat16, progress=False)
    assert all(lw.fused is not None and lw.fused.block_k for lw in model.layers)
    built = _stack_builds(monkeypatch)
    got = afd_greedy(engine_cfg(fp8, dtype="bfloat16"))[0]
    assert built and _blocks(built) == {BLOCK[1]}
    built.clear()
    assert got == afd_greedy(engine_cfg(dense, dtype="bfloat16"))[0]
    assert built and _blocks(built) == {0}


def test_fp8_attention_with_bf16_experts_in_the_decode_stack(pairs, tmp_path, monkeypatch):
    """FP8 projections with bf16 experts (a checkpoint that leaves its experts unquantized):
    the decode stack passes the projections' codes and the experts' bf16 weights; the tokens
    are the dense twin's."""
    import shutil

    fp8, dense = pairs["qwen3_moe"]
    mixed = tmp_path / "mixed"
    shutil.copytree(fp8, mixed)
    tensors = load_file(str(fp8 / "model.safetensors"))
    dense_t = load_file(str(dense / "model.safetensors"))
    experts = [k for k in tensors if ".experts." in k]
    assert experts
    for k in experts:
        if k.endswith("weight_scale_inv"):
            del tensors[k]
        else:
            tensors[k] = dense_t[k].to(torch.bfloat16)
    save_file(tensors, str(mixed / "model.safetensors"))
    built = _stack_builds(monkeypatch)
    got = afd_greedy(engine_cfg(mixed, dtype="bfloat16"))[0]
    # qwen3_moe's dense layer keeps its FP8 MLP
    assert built and all(a == BLOCK[1] and e in (0, None) for layers in built for a, e, _ in layers)
    assert got == afd_greedy(engine_cfg(dense, dtype="bfloat16"))[0]


def _stack_heads(monkeypatch) -> list:
    """The LM heads decode-stack calls were given from here on (None: the call ran none)."""
    from afd.kernels.decode_stack import NativeDecodeStack

    heads = []
    real = NativeDecodeStack.__call__

    def spy(stack, *args, **kwargs):
        heads.append(inspect.signature(real).bind(stack, *args, **kwargs).arguments.get("head"))
        return real(stack, *args, **kwargs)

    monkeypatch.setattr(NativeDecodeStack, "__call__", spy)
    return heads


def test_quantize_lm_head_gives_the_tokens_of_its_fp8_numbers(
    pairs, native_path, monkeypatch, tmp_path
):
    """`--quantize-lm-head` on a block-FP8 checkpoint whose head is bf16: the head is quantized
    as it loads (the bytes an independent quantizer writes, test helper's), the decode stack
    runs it in FP8, and the tokens are those of the same numbers served dense."""
    from afd.checkpoint import load_weights

    fp8, _ = pairs["qwen3_moe"]
    src = fp8.parent / "src"
    keep = tuple(k for k in checkpoints._NOT_FP8 if k != "lm_head")
    head_fp8, head_dense = checkpoints.block_fp8_pair(src, tmp_path, BLOCK, keep=keep)
    cfg = ModelConfig.from_hf(fp8).with_quantization(None, lm_head=True)
    assert cfg.quantize_lm_head and cfg.weight_block == BLOCK
    head = load_weights(cfg, "attention", torch.bfloat16)["lm_head"]
    file = load_file(str(head_fp8 / "model.safetensors"))
    want = BlockFP8.from_checkpoint(file["lm_head.weight"], file["lm_head.weight_scale_inv"], BLOCK)
    assert isinstance(head, BlockFP8)
    assert torch.equal(head.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(head.scale, want.scale)
    heads = _stack_heads(monkeypatch)
    got = afd_greedy(replace(engine_cfg(fp8, dtype="bfloat16"), model=cfg))[0]
    assert any(h is not None and isinstance(h.weight, BlockFP8) for h in heads)
    heads.clear()
    assert got == afd_greedy(engine_cfg(head_dense, dtype="bfloat16"))[0]
    assert any(h is not None and not isinstance(h.weight, BlockFP8) for h in heads)


def test_mxfp4_experts_with_fp8_attention_and_head(native_path, tmp_path, monkeypatch):
    """gpt-oss with MXFP4 experts served with `--quantization fp8 --quantize-lm-head` (`afd bench
    peer --quant mxfp4`'s afd): the experts stay MXFP4, attention (biases, sinks) and the head
    go block-FP8 in 128x128 blocks, and the tokens are those of the same numbers with attention
    and head dense (an independent quantizer's), in the decode stack with the FP8 head."""
    fp8_src = checkpoints.REFERENCE_CHECKPOINTS["gpt_oss"](tmp_path / "src")
    mx, _ = checkpoints.gpt_oss_mxfp4(fp8_src, tmp_path / "mx")
    keep = tuple(k for k in checkpoints._NOT_FP8 if k != "lm_head")
    _, twin = checkpoints.block_fp8_pair(mx, tmp_path / "twin", (128, 128), keep=keep)
    cfg = ModelConfig.from_hf(mx).with_quantization("fp8", lm_head=True)
    assert cfg.mxfp4_experts and cfg.quantize_on_load and cfg.quantize_lm_head
    heads = _stack_heads(monkeypatch)
    got = afd_greedy(replace(engine_cfg(mx, dtype="bfloat16"), model=cfg))[0]
    assert any(h is not None and isinstance(h.weight, BlockFP8) for h in heads)
    assert got == afd_greedy(engine_cfg(twin, dtype="bfloat16"))[0]


def test_quantize_lm_head_needs_fp8_weights_and_quantizes_a_tied_head(pairs, tmp_path):
    """Without block-FP8 weights the flag is a one-line error; a tied head is quantized from
    the embedding, which stays as it is."""
    import shutil

    from afd.checkpoint import load_weights

    fp8, dense = pairs["qwen3_moe"]
    with pytest.raises(ConfigError, match="--quantize-lm-head needs block-FP8 weights"):
        ModelConfig.from_hf(dense).with_quantization(None, lm_head=True)
    tied = tmp_path / "tied"
    shutil.copytree(fp8, tied)
    tensors = load_file(str(fp8 / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tied / "model.safetensors"))
    raw = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    cfg = ModelConfig.from_hf(tied).with_quantization("fp8", lm_head=True)
    w = load_weights(cfg, "attention", torch.bfloat16)
    assert isinstance(w["lm_head"], BlockFP8) and isinstance(w["embed"], torch.Tensor)
    want = BlockFP8.from_checkpoint(*blockfp8.quantize_blocks(w["embed"], BLOCK), BLOCK)
    assert torch.equal(w["lm_head"].q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(w["lm_head"].scale, want.scale)


def test_ue8m0_scales_load(tmp_path):
    src = REFERENCE_CHECKPOINTS["deepseek_v3"](tmp_path / "src")
    fp8, dense = block_fp8_pair(src, tmp_path, (128, 128), e8m0=True)
    assert afd_greedy(engine_cfg(fp8, S=1))[0] == afd_greedy(engine_cfg(dense, S=1))[0]


def test_weights_stay_fp8_in_both_services(pairs):
    fp8, dense = pairs["deepseek_v3"]
    cfg = ModelConfig.from_hf(fp8)
    att = AttentionModel(cfg, torch.bfloat16, progress=False)
    ffn = FFNEngine(cfg, ExpertShard(0, 1, cfg.num_experts), torch.bfloat16, progress=False)
    linears = [v for v in vars(att.layers[1].kind).values() if isinstance(v, Linear)]
    linears += [att.layers[1].o_proj, *ffn.experts[1].w13, *ffn.experts[1].w2]
    linears += [ffn.shared[1].w13, ffn.dense[0].w2]
    assert linears and all(isinstance(lin.w, BlockFP8) for lin in linears)
    # one byte a weight plus a float32 scale per row per K-block (about 3% more at DeepSeek's
    # 128-wide blocks; 12% at this checkpoint's 48 of 64) and nothing else
    for lin in linears:
        N, K = lin.out_features, lin.in_features
        assert lin.w.nbytes == N * K + N * -(-K // BLOCK[1]) * 4


def test_a_mis_tiled_scale_is_a_checkpoint_error(pairs, tmp_path):
    fp8, _ = pairs["qwen3_moe"]
    cfg = ModelConfig.from_hf(fp8)
    with pytest.raises(
        CheckpointError, match=r"tensor .*_proj.weight.: scale_inv .* does not tile"
    ):
        AttentionModel(replace(cfg, weight_block=(16, 16)), torch.float32, progress=False)


def test_other_quantization_methods_are_refused(pairs, tmp_path):
    fp8, _ = pairs["qwen3_moe"]
    raw = json.loads((fp8 / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ConfigError, match="quantization 'gptq' is not supported"):
        ModelConfig.from_dict(raw)


def test_planted_scale_block_order_bug_is_caught(pairs, monkeypatch):
    fp8, dense = pairs["deepseek_v3"]
    ref = afd_greedy(engine_cfg(dense, S=1))[0]
    real = BlockFP8.from_checkpoint

    def flipped(q, scale_inv, block):
        return real(q, scale_inv.flip(1), block)  # K-blocks' scales in reverse order

    monkeypatch.setattr(blockfp8.BlockFP8, "from_checkpoint", staticmethod(flipped))
    assert afd_greedy(engine_cfg(fp8, S=1))[0] != ref


def test_afd_quantize_writes_what_the_loader_keeps_in_fp8(pairs, tmp_path):
    """`afd quantize --fp8-block` at the test's block shape writes the same bytes as the
    test's own quantizer, sharded as the source was; refused over an existing directory."""
    from afd_cli.main import main

    src = REFERENCE_CHECKPOINTS["step3_text"](tmp_path / "src")  # two shards, stacked experts
    dst = tmp_path / "q"
    assert main(["quantize", "--fp8-block", "--block", "32x48", str(src), str(dst)]) == 0
    assert (dst / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_hf(dst)
    assert cfg.weight_block == BLOCK
    ffn = FFNEngine(cfg, ExpertShard(0, 2, cfg.num_experts), torch.float32, progress=False)
    assert isinstance(ffn.experts[1].w13[0].w, BlockFP8)
    assert main(["quantize", "--fp8-block", str(src), str(dst)]) == 2

    fp8, dense = pairs["qwen3_moe"]
    src = fp8.parent / "src"
    mine = tmp_path / "mine"
    assert main(["quantize", "--fp8-block", "--block", "32x48", str(src), str(mine)]) == 0
    theirs, ours = (
        load_file(str(fp8 / "model.safetensors")),
        load_file(str(mine / "model.safetensors")),
    )
    assert theirs.keys() == ours.keys()
    for k, t in theirs.items():
        assert torch.equal(t.view(torch.uint8) if t.dtype == FP8 else t, _bytes(ours[k])), k
    assert afd_greedy(engine_cfg(mine, S=1))[0] == afd_greedy(engine_cfg(dense, S=1))[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_quantization_fp8_on_load_is_afd_quantize_ahead_of_time(pairs, family, tmp_path):
    """`--quantization fp8` (ModelConfig.with_quantization) on a bf16/fp32 checkpoint: both
    services hold exactly the FP8 weights that `afd quantize --fp8-block` writes (128x128
    blocks), so the tokens are the quantized checkpoint's."""
    from afd.checkpoint import load_weights
    from afd_cli.main import main

    src = pairs[family][0].parent / "src"
    ahead = tmp_path / "q"
    assert main(["quantize", "--fp8-block", str(src), str(ahead)]) == 0
    online, stored = ModelConfig.from_hf(src).with_quantization("fp8"), ModelConfig.from_hf(ahead)
    assert online.quantize_on_load and online.weight_block == stored.weight_block == (128, 128)
    fp8 = 0
    for role in ("attention", "ffn"):
        got, want = (
            load_weights(online, role, torch.float32),
            load_weights(stored, role, torch.float32),
        )
        assert got.keys() == want.keys()
        for name, w in want.items():
            assert type(got[name]) is type(w), name
            if isinstance(w, BlockFP8):
                fp8 += 1
                assert torch.equal(got[name].q.view(torch.uint8), w.q.view(torch.uint8)), name
                assert torch.equal(got[name].scale, w.scale), name
            else:
                assert torch.equal(got[name], w), name
    assert fp8 > 0
    cfg = replace(engine_cfg(src, S=1), model=online)
    assert afd_greedy(cfg)[0] == afd_greedy(engine_cfg(ahead, S=1))[0]


def test_quantization_other_than_fp8_is_refused_and_fp8_checkpoints_stay(pairs):
    fp8, dense = pairs["qwen3_moe"]
    stored = ModelConfig.from_hf(fp8)
    assert stored.with_quantization("fp8") is stored  # already block-FP8, its own blocks
    with pytest.raises(ConfigError, match="--quantization 'awq': afd quantizes weights to fp8"):
        ModelConfig.from_hf(dense).with_quantization("awq")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t
