"""The resident-bytes child of `afd bench weights` and `afd bench mxfp4`: a fresh process's
growth when it loads an FFN shard covers the expert bytes the shard holds. On a box where the
kernel path's start-up measurement frees its buffers into glibc's heap (AVX-512 boxes), an
untrimmed baseline let loading reuse that memory and hid the weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd_cli.bench.engine import write_random_checkpoint
from afd_cli.bench.weights import resident

CONFIG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("resident") / "m", "Qwen3Moe", CONFIG)


def test_ffn_resident_covers_its_experts(checkpoint: Path) -> None:
    c = CONFIG
    experts = c["num_hidden_layers"] * c["num_experts"] * 3 * c["hidden_size"]
    experts *= c["moe_intermediate_size"] * 2  # bf16 bytes: 12.6 MB
    got = resident("ffn", checkpoint)
    assert experts <= got < 3 * experts, (got, experts)
