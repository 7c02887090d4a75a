import os

import pytest
import torch

from afd.kernels import paths
from tests.helpers import checkpoints, kernels

# Tests are sized for a 2-core machine; keep torch from oversubscribing it.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return checkpoints.qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory):
    return checkpoints.mixtral(tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory):
    """gpt-oss's test checkpoint: biases, sinks, a sliding window of 8, BF16 experts."""
    return checkpoints.gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "ckpt")


@pytest.fixture(scope="session")
def step3_dir(tmp_path_factory):
    """The demo model's Step-3 shape (MFA, a shared expert, dense layers), random weights."""
    from afd.demo import TINY_CONFIG, write_step3_checkpoint

    path = tmp_path_factory.mktemp("s3") / "ckpt"
    return write_step3_checkpoint(path, TINY_CONFIG, seed=5, init_std=0.2)


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory):
    """DeepSeek-V3 at dims the fused MLA layer takes (checkpoints.MLA_FUSED_DIMS): a dense first
    layer, then MoE layers with a shared expert and grouped routing."""
    path = tmp_path_factory.mktemp("deepseek") / "ckpt"
    return checkpoints.deepseek_v3(path, **checkpoints.MLA_FUSED_DIMS)


@pytest.fixture(scope="session")
def dsa_dir(tmp_path_factory):
    """DeepSeek-V3.2 (sparse attention, 8 tokens kept per query) at the fused MLA layer's dims,
    its indexer's keys wider than the rotary part they share."""
    path = tmp_path_factory.mktemp("dsa") / "ckpt"
    return checkpoints.deepseek_v32(path, index_head_dim=32, **checkpoints.MLA_FUSED_DIMS)


@pytest.fixture(scope="session")
def gpt_oss_mxfp4_dir(gpt_oss_dir, tmp_path_factory):
    """The same model with its experts in MXFP4 (the checkpoint layout)."""
    return checkpoints.gpt_oss_mxfp4(gpt_oss_dir, tmp_path_factory.mktemp("gpt_oss_mx"))[0]


@pytest.fixture(params=kernels.NATIVE or [pytest.param(None, marks=kernels.NO_NATIVE)])
def native_path(request, monkeypatch):
    """Each of afd's own kernel paths this machine runs (AVX2, AVX-512 BF16, AMX), active for the
    test, with afd's matmul at every batch size (oneDNN's takes none over), so a fused kernel
    and the per-op path it replaces run the same matmuls."""
    monkeypatch.setenv("AFD_ONEDNN_FROM_ROWS", "0")
    with paths.use(request.param) as p:
        yield p


@pytest.fixture(params=kernels.ALL)
def kernel_path(request):
    """Every kernel path this machine runs, as AFD_KERNELS would force it."""
    with paths.use(request.param) as p:
        yield p


@pytest.fixture(params=["ties_native", "ties_to_torch"])
def tie_routing(request):
    """Both ways a fused decode call meets a router top-k tie across the cut: routed in the
    call by topk.c's replay of torch.topk (where afd/kernels/topk.py's check passed), or the
    layer handed back to torch. Yields whether the call routes ties itself."""
    from afd.kernels import topk

    native = request.param == "ties_native"
    if native and not topk.trust():
        pytest.skip("topk.c does not pick among ties as this torch does")
    topk.set_trusted(native)
    try:
        yield native
    finally:
        topk.set_trusted(topk.trust())
