"""The FP8 KV cache (`--kv-cache-dtype fp8`): K and V stored as e4m3 with a float32 scale per
token and head, read back as the compute dtype.

Exact where it can be: on the torch path, every family's greedy tokens (prefill, chunked
prefill, decode, S = 2) with an FP8 cache equal those of a bf16 cache holding the same numbers
(each row quantized and dequantized by the same codec before it is stored): the cache stores,
gathers and scales what it was given, in every attention kind (GQA with sinks and windows, MFA,
MLA's latent and its expanded prefill, DeepSeek's sparse attention). Lossy by design: the logits
against the float32 reference, teacher-forced, stated against bf16's own error (random-weight
models are chaotic, so e4m3's 3 mantissa bits move them a lot; measured figures in the README).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.kernels import paths
from afd.quant import quantize_fp8
from services.attention import kv_cache
from services.attention.kv_cache import CacheLayout, KVCache, num_blocks_for
from tests.helpers.checkpoints import REFERENCE_CHECKPOINTS
from tests.integration.test_engine_reference import afd_greedy, engine_cfg
from tests.integration.test_fp8_wire import _all_logits


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {f: w(tmp_path_factory.mktemp(f) / "ckpt") for f, w in REFERENCE_CHECKPOINTS.items()}


def _quantized_then_stored(monkeypatch) -> None:
    """A bf16 cache that stores each row as the FP8 cache would read it back."""
    real = KVCache._put

    def put(pool, scale, slots, x):  # x [T, kvh, D]
        kvh, D = x.shape[1], x.shape[2]
        q, s = quantize_fp8(x.transpose(0, 1).reshape(-1, D))
        same = (q.float() * s[:, None]).to(x.dtype).view(kvh, -1, D).transpose(0, 1)
        return real(pool, scale, slots, same)

    monkeypatch.setattr(KVCache, "_put", staticmethod(put))


def _tokens(path, kv: str) -> list[list[int]]:
    cfg = engine_cfg(path, dtype="bfloat16", S=2, budget=16)
    cfg = replace(cfg, cache=replace(cfg.cache, kv_cache_dtype=kv))
    with paths.use("torch"):
        return afd_greedy(cfg)[0]


@pytest.mark.parametrize("family", list(REFERENCE_CHECKPOINTS))
def test_an_fp8_cache_gives_the_tokens_of_its_numbers_in_bf16(ckpts, family, monkeypatch):
    got = _tokens(ckpts[family], "fp8")
    _quantized_then_stored(monkeypatch)
    assert got == _tokens(ckpts[family], "auto")


def test_planted_scale_of_the_wrong_head_is_caught(ckpts, monkeypatch):
    """Each head's rows carry their own scale: read with the first head's, GQA's tokens move."""
    got = _tokens(ckpts["qwen3_moe"], "fp8")
    real = kv_cache.gather

    def first_head_scale(pool, scale, dim, index, dtype):
        if scale is not None and scale.dim() == 3:
            scale = scale[:1].expand_as(scale)
        return real(pool, scale, dim, index, dtype)

    monkeypatch.setattr(kv_cache, "gather", first_head_scale)
    from services.attention import paged_attention

    monkeypatch.setattr(paged_attention, "gather", first_head_scale)
    assert _tokens(ckpts["qwen3_moe"], "fp8") != got


def test_the_cache_holds_a_byte_per_value_and_a_scale_per_row(ckpts):
    layout = CacheLayout(heads=4, k_dim=64, v_dim=64)
    assert layout.bytes_per_token(8, torch.bfloat16, fp8=True) == 8 * 4 * (128 + 8)
    assert layout.bytes_per_token(8, torch.bfloat16) == 8 * 4 * 256
    mc = ModelConfig.from_hf(ckpts["qwen3_moe"])
    lay = CacheLayout(mc.num_kv_heads, mc.head_dim, mc.head_dim)
    cfg = CacheConfig(block_size=16, kv_cache_memory_gb=0.01)
    bf16 = num_blocks_for(lay, mc, cfg, torch.bfloat16)
    fp8 = num_blocks_for(lay, mc, replace(cfg, kv_cache_dtype="fp8"), torch.bfloat16)
    per_token = lay.bytes_per_token(mc.num_layers, torch.bfloat16, fp8=True)
    assert fp8 == int(0.01 * (1 << 30)) // (16 * per_token) and fp8 > 1.5 * bf16
    cache = KVCache(lay, 2, 8, 4, torch.bfloat16, fp8=True)
    assert cache.k[0].dtype == torch.float8_e4m3fn and cache.k_scale[0].shape == (lay.heads, 8, 4)
    mla = KVCache(CacheLayout(1, 72, 64, v_in_k=True), 1, 8, 4, torch.bfloat16, fp8=True)
    assert mla.v_scale[0] is mla.k_scale[0]  # V is K's first columns: one scale per row


@pytest.mark.parametrize("family", ["qwen3_moe", "step3_text"])
def test_fp8_cache_logits_stay_near_bf16s_error(ckpts, family):
    """Teacher-forced over up to 160 positions on the default kernel path (attention on the torch
    path over the FP8 cache, the rest native): bounds from the measured errors (README)."""
    path = ckpts[family]
    mc = ModelConfig.from_hf(path)
    base = EngineConfig(
        model=mc, dtype="bfloat16", a2f_dtype="bf16",
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    n = min(160, mc.max_position)
    tokens = torch.randint(0, min(256, mc.vocab_size), (n,), generator=g).tolist()
    out = {}
    from afd_cli.local import local_engine

    for name, dtype, wire, kv in (
        ("ref", "float32", "fp32", "auto"), ("bf16", "bfloat16", "bf16", "auto"),
        ("fp8", "bfloat16", "bf16", "fp8"),
    ):  # fmt: skip
        cache = replace(base.cache, kv_cache_dtype=kv)
        cfg = replace(base, dtype=dtype, a2f_dtype=wire, cache=cache)
        with local_engine(cfg, 1, progress=False) as eng:
            out[name] = _all_logits(eng, tokens).float()
    err = {k: (out[k] - out["ref"]).abs() for k in ("bf16", "fp8")}
    top1 = (out["fp8"].argmax(-1) == out["ref"].argmax(-1)).float().mean().item()
    print(f"{family}: max {err['bf16'].max():.3f} -> {err['fp8'].max():.3f}, mean "
          f"{err['bf16'].mean():.4f} -> {err['fp8'].mean():.4f}, top-1 {top1:.3f}")  # fmt: skip
    assert err["fp8"].mean() <= 5 * err["bf16"].mean()
    assert err["fp8"].max() <= 6 * err["bf16"].max()
    assert top1 >= 0.75
