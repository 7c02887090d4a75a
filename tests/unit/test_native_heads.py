"""Each head's own matmul (afd/kernels/heads.c), MLA's absorbed W_UK and W_UV: on every native
path, each head's result is the path's Linear matmul of that head's matrix bit for bit (the same
kernel), within bf16 rounding of a float32 reference, reading strided heads and writing into a
slice of a wider buffer."""

from __future__ import annotations

import pytest
import torch

from afd.kernels import gemm
from afd.kernels.heads import HeadMatmul

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)


@pytest.mark.parametrize("T,nh,N,K", [(1, 4, 64, 32), (5, 3, 32, 64), (33, 16, 256, 64)])
def test_each_head_is_its_own_linear(native_path, T, nh, N, K):
    g = torch.Generator().manual_seed(T * nh + N)
    w = torch.randn(nh, N, K, generator=g).to(torch.bfloat16)
    wide = torch.randn(T, nh, K + 16, generator=g).to(torch.bfloat16)
    x = wide[..., :K]  # a head's rows are K + 16 apart, as q_nope's in the query
    hm = HeadMatmul(w, native_path.matmul)
    out = torch.full((T, nh, N + 8), 7.0, dtype=torch.bfloat16)
    y = hm(x, out=out[..., :N])
    assert y.data_ptr() == out.data_ptr() and bool((out[..., N:] == 7.0).all())  # left alone
    for h in range(nh):
        alone = gemm.bf16_linear(x[:, h].contiguous(), gemm.lay_out(w[h], hm.isa_name), hm.isa_name)
        assert torch.equal(y[:, h], alone), h
    ref = torch.einsum("thk,hnk->thn", x.float(), w.float())
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-2)
    assert torch.equal(hm(x), y)  # a fresh result: the same


def test_shapes_the_kernels_do_not_take_are_refused(native_path):
    isa = native_path.matmul
    assert HeadMatmul.usable(torch.zeros(2, 16, 32, dtype=torch.bfloat16), isa)
    assert not HeadMatmul.usable(torch.zeros(2, 24, 32, dtype=torch.bfloat16), isa)  # rows
    assert not HeadMatmul.usable(torch.zeros(2, 16, 48, dtype=torch.bfloat16), isa)  # K
    assert not HeadMatmul.usable(torch.zeros(2, 16, 32), isa)  # float32
    assert not HeadMatmul.usable(torch.zeros(2, 16, 32, dtype=torch.bfloat16), "onednn")
    with pytest.raises(ValueError, match="HeadMatmul"):
        HeadMatmul(torch.zeros(2, 24, 32, dtype=torch.bfloat16), isa)


def test_mla_takes_torchs_bmm_from_the_per_head_bound(native_path, deepseek_dir, monkeypatch):
    """MLA's W_UK and W_UV run per head below HeadMatmul's rows, torch's bmm from there (the
    fused layer stops at the same bound); both ways give the same values to bf16 rounding."""
    from afd.config import ModelConfig
    from afd.kernels.heads import ROWS_BELOW
    from services.attention.model import AttentionModel

    cfg = ModelConfig.from_hf(deepseek_dir)
    model = AttentionModel(cfg, torch.bfloat16, progress=False)
    lw = model.layers[0]
    bound = ROWS_BELOW[native_path.matmul]
    assert lw.kind.uk is not None and lw.fused.rows_below == bound
    calls = []
    real = HeadMatmul.__call__
    spy = lambda s, *a, **k: calls.append(1) or real(s, *a, **k)  # noqa: E731
    monkeypatch.setattr(HeadMatmul, "__call__", spy)
    m, nh = cfg.mla, cfg.num_heads
    g = torch.Generator().manual_seed(0)
    q_nope = torch.randn(bound, nh, m.qk_nope_head_dim, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(bound, nh, m.qk_rope_head_dim, generator=g).to(torch.bfloat16)
    o = torch.randn(bound, nh * m.kv_lora_rank, generator=g).to(torch.bfloat16)
    per_head = [lw.kind.absorb(q_nope[:-1], q_pe[:-1]), lw.kind.values(o[:-1])]
    assert len(calls) == 2
    by_torch = [lw.kind.absorb(q_nope, q_pe), lw.kind.values(o)]
    assert len(calls) == 2  # none more at the bound
    for a, b in zip(per_head, by_torch, strict=True):
        torch.testing.assert_close(a.float(), b[:-1].float(), rtol=2**-7, atol=2e-2)


def test_mla_holds_kv_b_once_where_the_path_keeps_it_row_major(native_path, deepseek_dir):
    """W_UK and W_UV for torch's matmuls (decode batches above the bound, the expanded
    prefill) are views of the per-head kernel's matrices on avx512bf16 (row-major there), a
    copy of their own on the paths that re-lay them out; the same values either way."""
    from afd.checkpoint import load_weights
    from afd.config import ModelConfig
    from services.attention.model import AttentionModel

    cfg = ModelConfig.from_hf(deepseek_dir)
    kind = AttentionModel(cfg, torch.bfloat16, progress=False).layers[0].kind
    m, nh = cfg.mla, cfg.num_heads
    dn = m.qk_nope_head_dim
    kv_b = load_weights(cfg, "attention", torch.bfloat16, None, False)["layers.0.kv_b_proj"]
    kv_b = kv_b.view(nh, dn + m.v_head_dim, m.kv_lora_rank)
    assert torch.equal(kind.w_uk, kv_b[:, :dn]) and torch.equal(kind.w_uv, kv_b[:, dn:].mT)
    shared = kind.w_uk.data_ptr() == kind.uk.w.data_ptr()
    assert shared == (native_path.matmul == "avx512bf16")
    assert shared == (kind.w_uv.data_ptr() == kind.uv.w.data_ptr())
