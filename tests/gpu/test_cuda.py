"""afd on a CUDA device, against the same references as the CPU tests: every family's greedy
tokens (float32: identical to transformers; bf16: within the CPU tests' near-tie tolerance),
Step-3 against the dense reference, attention on the GPU with experts on the CPU and the
reverse (in one process and over tcp), the KV cache planned on the device, and the grouped
experts against the CPU's loop. Skipped where no CUDA device is visible; scripts/gpu/check.sh
runs it on a GPU machine. AFD_GPU_TESTS_DEVICE=cpu runs the same tests on the CPU: a check of
the tests themselves, not of a GPU."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd_cli.local import local_engine
from tests.helpers.checkpoints import (
    DENSE_REFERENCES,
    REFERENCE_CHECKPOINTS,
    TRANSFORMERS_REFERENCED,
)
from tests.integration import test_engine_reference as _engine_reference
from tests.integration.test_engine_reference import (
    BF16_GAP,
    NEW,
    PROMPTS,
    _gaps_summary,
    _hf_bf16,
    afd_greedy,
    engine_cfg,
)

DEV = os.environ.get("AFD_GPU_TESTS_DEVICE", "cuda")
# the float32 transformers references on the CPU, the fixture the CPU tests use
refs = _engine_reference.refs
pytestmark = pytest.mark.skipif(
    DEV.startswith("cuda") and not torch.cuda.is_available(),
    reason="no CUDA device is visible: tests/gpu runs on a GPU machine (scripts/gpu/check.sh)",
)


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
@pytest.mark.parametrize("S", [1, 2])
def test_fp32_tokens_identical_on_cuda(refs, family, S):
    path, _, ref = refs[family]
    assert afd_greedy(engine_cfg(path, S=S, device=DEV))[0] == ref


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
def test_bf16_within_near_tie_tolerance_on_cuda(refs, family):
    path, ref_model, _ = refs[family]
    hf_gap, hf_agree = _hf_bf16(family, path, ref_model)
    max_gap, min_agree = max(BF16_GAP, hf_gap), min(0.9, hf_agree - 0.05)
    got = afd_greedy(engine_cfg(path, dtype="bfloat16", S=2, device=DEV))[0]
    gap, agree = _gaps_summary(ref_model, got)
    assert gap <= max_gap, f"afd chose a token {gap:.3f} below the reference best"
    assert agree >= min_agree, f"afd bf16 on cuda agrees with the reference at only {agree:.0%}"


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
def test_chunked_prefill_and_preemption_on_cuda(refs, family):
    path, _, ref = refs[family]
    got, preemptions = afd_greedy(engine_cfg(path, S=2, blocks=16, budget=8, device=DEV))
    assert preemptions > 0 and got == ref


@pytest.mark.parametrize("model_type", sorted(DENSE_REFERENCES))
def test_dense_reference_families_on_cuda(model_type, tmp_path):
    path = REFERENCE_CHECKPOINTS[model_type](tmp_path / "ckpt")
    prompts = [[1, 2, 3, 4, 5, 6, 7], list(range(30, 71)), [9]]
    ref = DENSE_REFERENCES[model_type](path, prompts, 12)
    cfg = EngineConfig(
        model=ModelConfig.from_hf(path), dtype="float32", a2f_dtype="fp32", micro_batches=2,
        device=DEV, cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
    )  # fmt: skip
    with local_engine(cfg, 2, progress=False) as eng:
        reqs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [r.output_token_ids for r in reqs] == ref


@pytest.mark.parametrize("attention,ffn", [(DEV, "cpu"), ("cpu", DEV)])
def test_mixed_devices_in_one_process(refs, attention, ffn):
    path, _, ref = refs["qwen3_moe"]
    cfg = engine_cfg(path, S=2, device=attention, ffn_device=ffn)
    assert afd_greedy(cfg, num_ffn=2)[0] == ref


@pytest.mark.parametrize("attention,ffn", [(DEV, "cpu"), ("cpu", DEV)])
def test_mixed_devices_over_tcp(refs, tmp_path, attention, ffn):
    """Attention on the GPU with its experts on two CPU FFN servers (the KTransformers-style
    split), and the reverse, as separate processes."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers.procs import Procs, free_port, generate, wait_attention_ready

    path, _, ref = refs["deepseek_v3"]
    procs = Procs(tmp_path)
    try:
        ffn_addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        for i, addr in enumerate(ffn_addrs):
            procs.start(f"ffn{i}", "ffn", "--model", str(path), "--shard", f"{i}/2",
                        "--listen", addr, "--dtype", "float32", "--device", ffn)  # fmt: skip
        att = f"127.0.0.1:{free_port()}"
        procs.start("att", "attention", "--model", str(path), "--ffn", ",".join(ffn_addrs),
                    "--listen", att, "--dtype", "float32", "--a2f-dtype", "fp32",
                    "--micro-batches", "2", "--device", attention, "--kv-cache-gb", "0.05",
                    "--gpu-memory-utilization", "0.3")  # fmt: skip
        wait_attention_ready(att, procs=procs, name="att")
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            got = [f.result()[0] for f in [ex.submit(generate, att, p, NEW) for p in PROMPTS]]
        assert got == ref
    finally:
        procs.stop_all()


def test_the_kv_cache_is_planned_on_the_device(refs):
    path, _, _ = refs["qwen3_moe"]
    cfg = replace(
        engine_cfg(path, dtype="bfloat16", device=DEV),
        cache=CacheConfig(block_size=16, gpu_memory_utilization=0.5),
    )
    with local_engine(cfg, progress=False) as eng:
        assert eng.cache.k[0].device.type == DEV.split(":")[0]
        if DEV.startswith("cuda"):
            assert eng.blocks.num_blocks > 1000
            free, total = torch.cuda.mem_get_info()
            assert free > 0.3 * total  # the pool left the other half of the device alone


def test_grouped_experts_on_cuda_match_the_cpu_loop():
    from afd.kernels import paths
    from afd.ops import Linear
    from services.ffn import experts
    from services.ffn.kinds import swiglu_clamped

    g = torch.Generator().manual_seed(0)
    n, H, inter, T, k = 8, 256, 128, 64, 4
    w13 = [(torch.randn(2 * inter, H, generator=g) / 16).bfloat16() for _ in range(n)]
    w2 = [(torch.randn(H, inter, generator=g) / 16).bfloat16() for _ in range(n)]
    b13 = [torch.randn(2 * inter, generator=g).bfloat16() for _ in range(n)]
    b2 = [torch.randn(H, generator=g).bfloat16() for _ in range(n)]
    act = partial(swiglu_clamped, limit=7.0, alpha=1.702)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.randint(0, n, (T, k), generator=g, dtype=torch.int32)
    wts = torch.rand(T, k, generator=g)

    def group(dev):
        with paths.use("torch"):
            lin = [Linear(w.to(dev), b.to(dev)) for w, b in zip(w13, b13, strict=True)]
            lin2 = [Linear(w.to(dev), b.to(dev)) for w, b in zip(w2, b2, strict=True)]
            return experts.ExpertGroup.build(0, lin, lin2, act)

    on_dev = group(DEV)
    assert on_dev.stacked is not None and on_dev.stacked.grouped(x.to(DEV))
    out = torch.zeros(T, H, dtype=torch.bfloat16, device=DEV)
    got = experts.routed_experts(x.to(DEV), ids.to(DEV), wts.to(DEV), on_dev, out)
    cpu = replace(group("cpu"), stacked=None)
    want = experts.routed_experts(x, ids, wts, cpu, torch.zeros(T, H, dtype=torch.bfloat16))
    err = (got.float().cpu() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, f"grouped experts on {DEV} differ from the CPU loop by {err:.2e}"


def test_triton_decode_attention_equals_the_torch_path_on_the_device():
    from tests.helpers.attention_cases import errors

    if not DEV.startswith("cuda"):
        pytest.skip("the Triton kernel runs on CUDA (the interpreter's check: tests/unit)")
    for case, err in errors(0, DEV).items():
        bound = 1.5e-2 if "bf16" in case else 1e-5
        assert err < bound, f"{case}: relative error {err:.2e} over {bound:.0e}"


def test_triton_decode_attention_at_step3_shape():
    """MFA at Step-3's head shape, 64 rows of 2,048 keys, against the torch path on the device."""
    from afd.kernels import cuda_attention
    from tests.helpers.attention_cases import reference

    if not DEV.startswith("cuda"):
        pytest.skip("the Triton kernel runs on CUDA (the interpreter's check: tests/unit)")
    g = torch.Generator().manual_seed(1)
    B, nh, D, bs, L = 64, 64, 256, 16, 2048
    nb = L // bs
    k = torch.randn(1, B * nb, bs, D, generator=g).bfloat16()
    v = torch.randn(1, B * nb, bs, D, generator=g).bfloat16()
    table = torch.randperm(B * nb, generator=g).view(B, nb)
    lens = torch.randint(L // 2, L + 1, (B,), generator=g)
    q = torch.randn(B, nh, D, generator=g).bfloat16()
    want = reference(q, k, v, table, lens, D**-0.5, None, 0)
    got = cuda_attention.decode_attention(
        q.cuda(), k.cuda(), v.cuda(), table.cuda(), lens.cuda(), D**-0.5
    )
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < 1.5e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
def test_an_fp8_cache_on_the_device_gives_the_tokens_of_its_numbers_in_bf16(
    refs, family, monkeypatch
):
    """The FP8 KV cache on CUDA (Triton decode reading e4m3 and scales) against a bf16 cache
    holding the same numbers (tests/integration/test_fp8_kv_cache.py's check, on the device)."""
    from tests.integration.test_fp8_kv_cache import _quantized_then_stored

    path, _, _ = refs[family]

    def tokens(kv):
        from afd.kernels import paths

        cfg = engine_cfg(path, dtype="bfloat16", S=2, budget=16, device=DEV)
        with paths.use("torch"):  # the CPU's native kernels read bf16 caches only (cpu runs)
            return afd_greedy(replace(cfg, cache=replace(cfg.cache, kv_cache_dtype=kv)))[0]

    got = tokens("fp8")
    _quantized_then_stored(monkeypatch)
    assert got == tokens("auto")
