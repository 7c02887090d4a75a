"""The fused native decode layer (afd/kernels/decode_layer.c) against the per-op path it
replaces in AttentionModel.attention: the same kernels in the same order, so the same bits,
in the hidden states, the FFN input, the KV cache and (its router matmul joining the call on
MoE layers) the routing; for GQA with and without q/k norm (Qwen3-MoE, Mixtral) and for
Step-3's MFA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from afd.config import ModelConfig
from afd.demo import TINY_CONFIG, write_step3_checkpoint
from services.attention.kv_cache import KVCache
from services.attention.model import AttentionModel
from services.attention.paged_attention import AttnMeta


@pytest.fixture(scope="module")
def step3_dir(tmp_path_factory):
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("s3") / "ckpt", TINY_CONFIG, seed=5, init_std=0.2
    )


@pytest.mark.parametrize("ckpt", ["qwen3_dir", "mixtral_dir", "step3_dir"])
def test_fused_decode_layer_is_bit_identical_to_the_per_op_path(native_path, ckpt, request):
    cfg = ModelConfig.from_hf(request.getfixturevalue(ckpt))
    model = AttentionModel(cfg, torch.bfloat16, progress=False)
    assert all(lw.fused is not None for lw in model.layers)
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    assert moe and all(model.layers[i].fused.experts == cfg.num_experts for i in moe)
    g = torch.Generator().manual_seed(0)
    num_blocks, bs = 24, 16
    lens = torch.tensor([1, 17, 40, 33, 64])  # keys per row, this step's token included
    blocks = torch.randperm(num_blocks, generator=g)[:20].view(5, 4)
    pos = lens - 1
    slots = blocks.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs
    meta = AttnMeta(
        positions=pos,
        slots=slots,
        num_decode=5,
        decode_blocks=blocks,
        prefills=(),
        decode_lens=lens,
    )
    h = (torch.randn(5, cfg.hidden_size, generator=g) * 4).to(torch.bfloat16)
    caches = []
    for _ in range(2):
        c = KVCache(model.cache_layout, cfg.num_layers, num_blocks, bs, torch.bfloat16)
        caches.append(c)
    for layer in range(cfg.num_layers):
        k = torch.randn(caches[0].k[layer].shape, generator=g).to(torch.bfloat16)
        v = torch.randn(caches[0].v[layer].shape, generator=g).to(torch.bfloat16)
        for c in caches:
            c.k[layer].copy_(k), c.v[layer].copy_(v)
    fused = model.layers
    plain = [replace(lw, fused=None) for lw in fused]
    for layer in range(cfg.num_layers):
        model.layers = fused
        h1, x1, ids1, w1 = model.attention_and_route(layer, h, meta, caches[0])
        model.layers = plain
        h2, x2, ids2, w2 = model.attention_and_route(layer, h, meta, caches[1])
        assert torch.equal(h1, h2) and torch.equal(x1, x2)
        assert torch.equal(ids1, ids2) and torch.equal(w1, w2)
        assert ids1.shape == (5, cfg.top_k if layer in moe else 0)
        assert torch.equal(caches[0].k[layer], caches[1].k[layer])
        assert torch.equal(caches[0].v[layer], caches[1].v[layer])
        assert not torch.equal(h1, h)  # attention did add something
        h = h1
