"""The resident-bytes child of `afd bench weights` and `afd bench mxfp4`: a fresh process's
growth when it loads an FFN shard covers the expert bytes the shard holds. On a box where the
kernel path's start-up measurement frees its buffers into glibc's heap (AVX-512 boxes), an
untrimmed baseline let loading reuse that memory and hid the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_cli.bench.weights import resident
from tests.helpers.checkpoints import qwen3_moe

# every layer's experts, a few MB of them: far less than what the start-up measurement frees
SHAPE = dict(hidden_size=256, moe_intermediate_size=256, num_experts=16, mlp_only_layers=[])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen3_moe(tmp_path_factory.mktemp("resident") / "m", **SHAPE)


def test_ffn_resident_covers_its_experts(checkpoint: Path) -> None:
    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    experts = layers * SHAPE["num_experts"] * 3 * SHAPE["hidden_size"]
    experts *= SHAPE["moe_intermediate_size"] * 2  # bf16 bytes
    got = resident("ffn", checkpoint)
    assert experts <= got < 3 * experts, (got, experts)


@pytest.fixture(scope="module")
def larger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Experts several times what a load leaves behind besides them (the engine's own buffers,
    allocator pages): CI boxes differ in that part by several MB, which at SHAPE's size swung the
    FP8/BF16 ratio of whole processes from 0.69 to 0.80."""
    shape = {**SHAPE, "hidden_size": 512, "moe_intermediate_size": 512}
    return qwen3_moe(tmp_path_factory.mktemp("resident") / "m", **shape)


def test_quantization_fp8_on_load_halves_the_experts(larger: Path) -> None:
    """The child takes --quantization's value: the same shard quantized as it loads holds about
    half the expert bytes (an e4m3 code per value and a float32 scale per 128 values of a row).
    Judged on what quantizing saves, so the load's fixed part cancels: unquantized it saves
    nothing; the saving falls short of the ideal by what the quantizer's float32 temporaries
    leave with the allocator."""
    cfg = json.loads((larger / "config.json").read_text())
    experts = cfg["num_hidden_layers"] * SHAPE["num_experts"] * 3 * 512 * 512 * 2  # bf16 bytes
    ideal = experts * (1 - (1 + 4 / 128) / 2)
    bf16, fp8 = resident("ffn", larger), resident("ffn", larger, quantization="fp8")
    assert 0.75 * ideal < bf16 - fp8 < 1.05 * ideal, (bf16, fp8, ideal)
    assert fp8 > experts * (1 + 4 / 128) / 2, (fp8, experts)  # the codes and scales are resident
