"""Each head's own matmul (afd/kernels/heads.c), MLA's absorbed W_UK and W_UV: on every native
path, each head's result is the path's Linear matmul of that head's matrix bit for bit (the same
kernel), within bf16 rounding of a float32 reference, reading strided heads and writing into a
slice of a wider buffer; dense() gives back the matrices as given."""

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


def test_dense_gives_back_the_matrices(native_path):
    w = torch.randn(3, 48, 64).to(torch.bfloat16)
    hm = HeadMatmul(w, native_path.matmul)
    assert torch.equal(hm.dense(), w)


def test_shapes_the_kernels_do_not_take_are_refused(native_path):
    isa = native_path.matmul
    assert HeadMatmul.usable(torch.zeros(2, 16, 32, dtype=torch.bfloat16), isa)
    assert not HeadMatmul.usable(torch.zeros(2, 24, 32, dtype=torch.bfloat16), isa)  # rows
    assert not HeadMatmul.usable(torch.zeros(2, 16, 48, dtype=torch.bfloat16), isa)  # K
    assert not HeadMatmul.usable(torch.zeros(2, 16, 32), isa)  # float32
    assert not HeadMatmul.usable(torch.zeros(2, 16, 32, dtype=torch.bfloat16), "onednn")
    with pytest.raises(ValueError, match="HeadMatmul"):
        HeadMatmul(torch.zeros(2, 24, 32, dtype=torch.bfloat16), isa)
