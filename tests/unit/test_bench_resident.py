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


def test_quantization_fp8_on_load_halves_the_experts(checkpoint: Path) -> None:
    """The child takes --quantization's value: the same shard quantized as it loads holds about
    half the bytes (e4m3 codes and a float32 scale per 128 values of each row; up to 0.72x of
    bf16 measured at these small sizes, where pages of the quantizer's float32 temporaries stay
    with the allocator; unquantized it would be 1x)."""
    bf16, fp8 = resident("ffn", checkpoint), resident("ffn", checkpoint, quantization="fp8")
    assert 0.4 * bf16 < fp8 < 0.8 * bf16, (fp8, bf16)
