"""A dense MLP added into a result in one native call (afd/kernels/mlp.c: DeepSeek's shared
expert, a dense layer's MLP), on every native path: within bf16 rounding of the torch MLP it
replaces (services/ffn/kinds.py: mlp) added to what `out` held, for both activations; the FFN
side's MLPWeights takes it where its matmuls are afd's kernels."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from afd.kernels import gemm
from afd.kernels.mlp import NativeMLP
from afd.ops import Linear
from services.ffn.experts import MLPWeights
from services.ffn.kinds import mlp, native_spec, swiglu, swiglu_clamped

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)


@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("clamped", [False, True])
def test_the_mlp_is_added_into_out(native_path, T, clamped):
    g = torch.Generator().manual_seed(T)
    H, inter = 64, 96
    w13 = (torch.randn(2 * inter, H, generator=g) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(H, inter, generator=g) * 0.2).to(torch.bfloat16)
    act = partial(swiglu_clamped, limit=1.5, alpha=1.702) if clamped else swiglu
    weights = MLPWeights(Linear(w13), Linear(w2), act)
    assert weights.native is not None and isinstance(weights.native, NativeMLP)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    before = torch.randn(T, H, generator=g).to(torch.bfloat16)
    out = before.clone()
    weights.add_into(x, out)
    ref = before.float() + mlp(x, Linear(w13), Linear(w2), act).float()  # torch's activation
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2e-2)
    assert not torch.equal(out, before)
    assert native_spec(act) is not None


@pytest.mark.parametrize("T", [1, 5, 40])
def test_block_fp8_weights_give_the_dense_weights_bits(native_path, T):
    """A block-FP8 shared expert in the native call: each matmul converted for the path as it
    goes (fp8_gemm.c), the bits of the same call on the dequantized weights."""
    from afd.blockfp8 import BlockFP8, quantize_blocks

    g = torch.Generator().manual_seed(T)
    H, inter = 64, 96

    def fp8(n: int, k: int) -> BlockFP8:
        w = torch.randn(n, k, generator=g)
        return BlockFP8.from_checkpoint(*quantize_blocks(w, (128, 32)), (128, 32))

    w13, w2 = fp8(2 * inter, H), fp8(H, inter)
    weights = MLPWeights(Linear(w13), Linear(w2), swiglu)
    assert weights.native is not None and weights.native.block_k == 32
    dense = MLPWeights(*(Linear(w.dequantize(torch.bfloat16)) for w in (w13, w2)), swiglu)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    before = torch.randn(T, H, generator=g).to(torch.bfloat16)
    got, want = before.clone(), before.clone()
    weights.add_into(x, got)
    dense.add_into(x, want)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got, before)


def test_biases_or_other_activations_keep_the_torch_mlp(native_path):
    w13 = torch.randn(64, 32).to(torch.bfloat16)
    w2 = torch.randn(32, 32).to(torch.bfloat16)
    assert MLPWeights(Linear(w13), Linear(w2), lambda g, u: g * u).native is None
    assert MLPWeights(Linear(w13, torch.zeros(64)), Linear(w2), swiglu).native is None
