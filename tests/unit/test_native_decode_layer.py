"""The fused native decode layer (afd/kernels/decode_layer.c) against the per-op path it
replaces in AttentionModel.attention_and_route: the same kernels in the same order, so the
same bits, in the hidden states, the FFN input, the KV cache and the router's logits (its
matmul joins the call on MoE layers); for GQA with and without q/k norm (Qwen3-MoE, Mixtral),
gpt-oss's GQA (biases, sinks, sliding windows shorter than the rows' contexts), Step-3's MFA
and DeepSeek's MLA in its absorbed form (mla_layer.c; with and without a query rank, and
V3.2's sparse attention: the indexer's selection in the call, indexer.c). The
routers in the call (softmax-then-top-k; gpt-oss's biased top-k-then-softmax) pick the same
experts as torch.topk with weights within float32 rounding, and leave a tie across the top-k
cut to torch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from afd.config import ModelConfig
from afd.kernels import gemm
from afd.kernels.mla_layer import NativeMLALayer
from services.attention.kv_cache import KVCache
from services.attention.model import AttentionModel
from services.attention.paged_attention import AttnMeta
from tests.helpers.checkpoints import MLA_FUSED_DIMS, deepseek_v3


@pytest.fixture(scope="module")
def deepseek_full_q_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsq") / "ckpt"
    return deepseek_v3(path, seed=8, q_lora_rank=None, **MLA_FUSED_DIMS)


@pytest.mark.parametrize(
    "ckpt",
    [
        "qwen3_dir", "mixtral_dir", "step3_dir", "gpt_oss_dir", "deepseek_dir",
        "deepseek_full_q_dir", "dsa_dir",
    ],
)  # fmt: skip
def test_fused_decode_layer_is_bit_identical_to_the_per_op_path(native_path, ckpt, request):
    cfg = ModelConfig.from_hf(request.getfixturevalue(ckpt))
    model = AttentionModel(cfg, torch.bfloat16, progress=False)
    assert all(lw.fused is not None for lw in model.layers)
    if cfg.mla is not None:
        assert all(isinstance(lw.fused, NativeMLALayer) for lw in model.layers)
        assert (cfg.mla.q_lora_rank == 0) == (ckpt == "deepseek_full_q_dir")
        assert all(lw.fused.indexed == (ckpt == "dsa_dir") for lw in model.layers)
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    assert moe and all(model.layers[i].fused.experts == cfg.num_experts for i in moe)
    _fused_vs_per_op(cfg, model, torch.tensor([1, 17, 40, 33, 64]))


def test_a_sparse_layer_keeps_every_position_of_short_rows_unscored(
    native_path, dsa_dir, monkeypatch
):
    """DSA rows with no more positions than index_topk keep them all: where every row of the
    batch does, neither path scores (the fused layer computes no indexer query either), and
    the two still give the same bits."""
    cfg = ModelConfig.from_hf(dsa_dir)
    model = AttentionModel(cfg, torch.bfloat16, progress=False)
    from afd.kernels import indexer

    def never(*a):
        raise AssertionError("scored rows that keep all their positions")

    monkeypatch.setattr(indexer, "index_scores", never)
    topk = cfg.indexer.topk
    _fused_vs_per_op(cfg, model, torch.tensor([1, topk, 3, topk - 1, topk]))


def _fused_vs_per_op(cfg, model, lens: torch.Tensor):  # lens [5]: keys per row, this step's
    # token included
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    g = torch.Generator().manual_seed(0)
    num_blocks, bs = 24, 16
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
        block_size=bs,
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
        if caches[0].index:  # DSA's indexer keys: the rows its selection scores
            ik = torch.randn(caches[0].index[layer].shape, generator=g).to(torch.bfloat16)
            for c in caches:
                c.index[layer].copy_(ik)
    fused = model.layers
    plain = [replace(lw, fused=None) for lw in fused]
    for layer in range(cfg.num_layers):
        model.layers = fused
        h1, x1, ids1, w1 = model.attention_and_route(layer, h, meta, caches[0])
        model.layers = plain
        h2, x2, ids2, w2 = model.attention_and_route(layer, h, meta, caches[1])
        assert torch.equal(h1, h2) and torch.equal(x1, x2)
        assert ids1.shape == ids2.shape == (5, cfg.top_k if layer in moe else 0)
        assert_same_routing(ids1, w1, ids2, w2)
        assert torch.equal(caches[0].k[layer], caches[1].k[layer])
        assert torch.equal(caches[0].v[layer], caches[1].v[layer])
        if caches[0].index:
            assert torch.equal(caches[0].index[layer], caches[1].index[layer])
        assert not torch.equal(h1, h)  # attention did add something
        h = h1


def assert_same_routing(ids1, w1, ids2, w2):
    """The same experts per row (order among equal weights is free: the FFN sums experts in
    expert order) with weights equal to float32 rounding."""
    o1, o2 = ids1.sort(dim=1), ids2.sort(dim=1)
    assert torch.equal(o1.values, o2.values)
    torch.testing.assert_close(
        w1.gather(1, o1.indices),
        w2.gather(1, o2.indices),
        rtol=3.2e-6,
        atol=0,  # a few ulps
    )


@pytest.mark.parametrize("ckpt", ["qwen3_dir", "gpt_oss_dir", "deepseek_dir"])
def test_a_tie_across_the_top_k_cut_is_torchs_choice(native_path, tie_routing, ckpt, request):
    """Every expert's router row the same (and the selection bias of gpt-oss or DeepSeek zero):
    all scores tie, so the call either picks exactly as torch.topk does (topk.c) or does not
    pick at all, for each router kind it computes (DeepSeek's: its groups tie too)."""
    cfg = ModelConfig.from_hf(request.getfixturevalue(ckpt))
    model = AttentionModel(cfg, torch.bfloat16, progress=False)
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    lw = model.layers[layer]
    assert lw.fused.topk == cfg.top_k
    same = torch.randn(1, cfg.hidden_size).to(torch.bfloat16).expand(cfg.num_experts, -1)
    lw.router.w.copy_(gemm.lay_out(same, lw.router.isa))  # its layout
    if lw.router_bias is not None:  # the bias would break the tie: zero, here and in the call
        lw.router_bias.zero_()
        mla = isinstance(lw.fused, NativeMLALayer)
        (lw.fused.router_bias if mla else lw.fused._extra[3]).zero_()
    T, bs = 3, 16
    meta = AttnMeta(
        positions=torch.zeros(T, dtype=torch.long),
        slots=torch.arange(T) * bs,
        num_decode=T,
        decode_blocks=torch.arange(T).view(T, 1),
        prefills=(),
        decode_lens=torch.ones(T, dtype=torch.long),
        block_size=bs,
    )
    cache = KVCache(model.cache_layout, cfg.num_layers, T, bs, torch.bfloat16)
    h = torch.randn(T, cfg.hidden_size).to(torch.bfloat16)
    cos, sin = lw.kind.rope.tables(torch.bfloat16)
    args = (h, meta.positions, meta.slots, meta.decode_blocks, meta.decode_lens,
            cache.k[layer], cache.v[layer], cos, sin, lw.kind.scale)  # fmt: skip
    _, x, logits, routing = lw.fused(*args)
    assert bool((logits == logits[:, :1]).all())
    want_ids, want_w = model.route_fn(logits, cfg, lw.router_bias)
    if tie_routing:
        assert routing is not None
        ids, w = routing
        assert torch.equal(ids, want_ids)  # torch.topk's pick among equals
        torch.testing.assert_close(w, want_w, rtol=2e-7, atol=0)  # expf vs torch's exp
    else:
        assert routing is None
    _, _, ids, w = model.attention_and_route(layer, h, meta, cache)
    assert torch.equal(ids, want_ids)
    if not tie_routing:
        assert torch.equal(w, want_w)  # torch's own choice


@pytest.mark.parametrize(
    "ckpt",
    ["qwen3_dir", "mixtral_dir", "step3_dir", "deepseek_dir", "deepseek_full_q_dir", "dsa_dir"],
)
def test_fused_layer_on_block_fp8_weights_is_the_per_op_path(native_path, ckpt, request, tmp_path):
    """Block-FP8 projections (w_qkv, MFA's w_q, w_o; MLA's w_a, w_qb, w_o; DSA's indexer's
    w_q, its w_k dense as V3.2 keeps its head weights) in the fused call: converted for its
    matmuls as the per-op path's Linear converts them (fp8_gemm.c), the same bits."""
    from afd.blockfp8 import BlockFP8
    from tests.helpers.checkpoints import block_fp8_pair

    fp8, _ = block_fp8_pair(request.getfixturevalue(ckpt), tmp_path, (32, 48))
    cfg = ModelConfig.from_hf(fp8)
    model = AttentionModel(cfg, torch.bfloat16, progress=False)
    assert all(lw.fused is not None and lw.fused.block_k == 48 for lw in model.layers)
    assert all(isinstance(lw.o_proj.w, BlockFP8) for lw in model.layers)
    if ckpt == "dsa_dir":  # the indexer's query FP8 in the call, its key and head weights dense
        from afd.kernels.indexer import Indexer

        ixs = [Indexer.from_address(lw.fused.layer.ix) for lw in model.layers]
        assert all(ix.f8_q.q and not ix.f8_k.q and ix.w_k and ix.bk == 48 for ix in ixs)
    _fused_vs_per_op(cfg, model, torch.tensor([1, 17, 40, 33, 64]))
