"""Device selection and the device-side pieces a CPU can check: names and their one-line
errors, the flags of every command, the KV plan on a CUDA device, a step that runs out of
device memory, and the grouped experts (the torch path on every device) against the expert
loop they replace."""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd.device import Memory, resolve
from afd.errors import ConfigError
from afd.kernels import paths
from afd.ops import Linear
from afd_cli.cluster import Cluster, ClusterConfig
from afd_cli.local import local_engine
from afd_cli.main import build_parser
from services.attention import engine as engine_mod
from services.attention.engine import Engine
from services.attention.kv_cache import DevicePlan
from services.ffn import experts
from services.ffn.kinds import swiglu, swiglu_clamped

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")


def test_device_names():
    assert resolve("cpu") == torch.device("cpu")
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "cuda0"):
        with pytest.raises(ConfigError, match="auto, cpu, cuda or cuda:N"):
            resolve(bad)


@NO_CUDA
def test_a_cuda_device_that_is_not_there_is_a_one_line_error():
    assert resolve("auto") == torch.device("cpu")  # auto: the CPU where no GPU is visible
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=rf"--device {spec}: no CUDA device.*--device cpu"):
            resolve(spec)


def test_configs_check_their_devices(qwen3_dir):
    mc = ModelConfig.from_hf(qwen3_dir)
    with pytest.raises(ConfigError, match="device must be"):
        EngineConfig(model=mc, device="tpu")
    with pytest.raises(ConfigError, match="device must be"):
        EngineConfig(model=mc, ffn_device="gpu")
    with pytest.raises(ConfigError, match="device must be"):
        ClusterConfig(attention_device="cuda:a")
    with pytest.raises(ConfigError, match="utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_every_compute_command_takes_a_device():
    p = build_parser()
    assert p.parse_args(["ffn", "--device", "cuda:1"]).device == "cuda:1"
    a = p.parse_args(["attention", "--ffn", "tcp://x:1", "--device", "cuda", "--ffn-device", "cpu",
                      "--gpu-memory-utilization", "0.8"])  # fmt: skip
    assert (a.device, a.ffn_device, a.gpu_memory_utilization) == ("cuda", "cpu", 0.8)
    assert p.parse_args(["generate", "--prompt", "x"]).device == "auto"


def test_afd_serve_gives_each_role_its_device(monkeypatch):
    from afd_cli import cluster

    monkeypatch.setattr(cluster, "one_gpu", lambda attention, ffn: False)  # as on a GPU host
    cfg = ClusterConfig(ffn=2, transport="tcp", attention_device="cuda", ffn_device="cpu")
    children = {c.name: c.argv for c in Cluster(cfg).plan()}

    def device(argv):
        return argv[argv.index("--device") + 1]

    assert device(children["attention-0"]) == "cuda"
    assert device(children["ffn-0"]) == device(children["ffn-1"]) == "cpu"
    both = {c.name: c.argv for c in Cluster(ClusterConfig(device="cuda:1")).plan()}
    assert all(device(a) == "cuda:1" for n, a in both.items() if n != "gateway")


@NO_CUDA
def test_afd_serve_refuses_a_gpu_that_is_not_there_before_starting_anything():
    with pytest.raises(ConfigError, match="--device cuda: no CUDA device"):
        Cluster(ClusterConfig(attention_device="cuda"))


def test_the_kv_pool_takes_what_the_device_has_left():
    gib = 1 << 30
    plan = DevicePlan(total=80 * gib, utilization=0.9, ours=20 * gib, free=60 * gib,
                      activations=2 * gib, block_bytes=gib // 4)  # fmt: skip
    assert plan.kv_bytes == 50 * gib and plan.num_blocks == 200
    assert "0.90 x 80.0 GiB" in plan.describe()
    # a second process on the device with its own share: never more than is free
    shared = replace(plan, utilization=0.45, ours=10 * gib, free=30 * gib)
    assert shared.kv_bytes == 26 * gib - 2 * gib
    crowded = replace(plan, free=10 * gib)
    assert crowded.kv_bytes == 8 * gib
    full = replace(plan, ours=71 * gib)
    assert full.kv_bytes < 0 and full.num_blocks == 0


def _device_engine(qwen3_dir, monkeypatch, memory: Memory, util=0.9) -> Engine:
    """An Engine planned as on a CUDA device: the meta device (no data) stands in for it."""
    monkeypatch.setattr(engine_mod, "resolve_device", lambda spec: torch.device("meta"))
    monkeypatch.setattr(engine_mod, "device_memory", lambda dev: memory)
    cfg = EngineConfig(
        model=ModelConfig.from_hf(qwen3_dir),
        device="cuda",
        cache=CacheConfig(block_size=4, gpu_memory_utilization=util),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
        ffn_addresses=("inproc://nobody",),
    )
    with paths.use("torch"):
        return Engine(cfg, progress=False)


def test_the_engine_plans_its_kv_pool_on_the_device(qwen3_dir, monkeypatch, caplog):
    mib = 1 << 20
    caplog.set_level("INFO", logger="afd.attention")
    eng = _device_engine(qwen3_dir, monkeypatch, Memory(1024 * mib, 1000 * mib, 24 * mib))
    assert eng.cache.k[0].device.type == "meta"
    assert eng.blocks.num_blocks > 100
    assert "KV cache on meta" in caplog.text and "GiB for activations" in caplog.text


def test_no_room_for_the_kv_pool_is_a_start_up_error(qwen3_dir, monkeypatch):
    mib = 1 << 20
    with pytest.raises(ConfigError, match="no room for a KV cache.*--gpu-memory-utilization"):
        _device_engine(qwen3_dir, monkeypatch, Memory(1024 * mib, 20 * mib, 1000 * mib))


def test_a_step_out_of_device_memory_fails_its_requests_and_the_engine_goes_on(qwen3_dir):
    cfg = EngineConfig(
        model=ModelConfig.from_hf(qwen3_dir),
        device="cpu",
        cache=CacheConfig(block_size=4, num_blocks=64),
    )
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with local_engine(cfg, progress=False) as eng:
        real = eng.runner.execute

        def out_of_memory(plan):
            eng.runner.execute = real
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        eng.runner.execute = out_of_memory
        failed = eng.add_request([5, 6, 7], greedy)
        eng.step()
        assert failed.finish_reason == "error" and "out of memory on cpu" in failed.error
        assert "--max-num-batched-tokens" in failed.error
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # its KV blocks are back
        (ok,) = eng.generate([[5, 6, 7]], greedy)
        assert len(ok.output_token_ids) == 4 and ok.finish_reason == "length"


def _group(dtype, biased, n=6, H=64, inter=32, first=2, seed=0):
    g = torch.Generator().manual_seed(seed)

    def lin(rows, cols):
        w = (torch.randn(rows, cols, generator=g) / 8).to(dtype)
        return Linear(w, torch.randn(rows, generator=g).to(dtype) if biased else None)

    act = partial(swiglu_clamped, limit=7.0, alpha=1.702) if biased else swiglu
    return experts.ExpertGroup.build(first, [lin(2 * inter, H) for _ in range(n)],
                                     [lin(H, inter) for _ in range(n)], act)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("biased", [False, True])
def test_grouped_experts_equal_the_expert_loop(dtype, biased):
    """Bit for bit, pairs of experts held by another shard included (ids 0, 1, 8, 9)."""
    with paths.use("torch"):
        group = _group(dtype, biased)
        assert group.stacked is not None and group.stacked.w13.shape == (6, 64, 64)
        loop = replace(group, stacked=None)
        T, k = 11, 3
        x = torch.randn(T, 64).to(dtype)
        ids = torch.randint(0, 10, (T, k), dtype=torch.int32)
        w = torch.rand(T, k)
        got = experts.routed_experts(x, ids, w, group, torch.zeros(T, 64, dtype=dtype))
        want = experts.routed_experts(x, ids, w, loop, torch.zeros(T, 64, dtype=dtype))
        assert torch.equal(got, want)
        none_here = torch.zeros(T, k, dtype=torch.int32)  # every pair elsewhere: adds nothing
        out = torch.ones(T, 64, dtype=dtype)
        got = experts.routed_experts(x, none_here, w, group, out)
        assert torch.equal(got, torch.ones_like(out))


def test_each_expert_multiplies_its_slice_of_the_stack():
    with paths.use("torch"):
        group = _group(torch.float32, False)
    st = group.stacked
    assert st is not None
    assert all(lin.w.data_ptr() == st.w13[e].data_ptr() for e, lin in enumerate(group.w13))
    assert all(lin.w.data_ptr() == st.w2[e].data_ptr() for e, lin in enumerate(group.w2))


def test_planted_unordered_pairs_in_the_grouped_experts_are_caught(monkeypatch):
    """Pairs not sorted by expert hand rows to the wrong expert's matmul."""
    real = torch.argsort
    monkeypatch.setattr(experts.torch, "argsort", lambda t, stable=True: torch.arange(t.numel()))
    with paths.use("torch"):
        group = _group(torch.float32, False)
        x, ids = torch.randn(5, 64), torch.tensor([[9, 2], [3, 2], [7, 4], [2, 6], [5, 3]])
        w = torch.rand(5, 2)
        got = experts.routed_experts(x, ids, w, group, torch.zeros(5, 64))
        monkeypatch.setattr(experts.torch, "argsort", real)
        want = experts.routed_experts(x, ids, w, replace(group, stacked=None), torch.zeros(5, 64))
    assert not torch.allclose(got, want)


def test_the_gpu_bench_runs_its_mfa_layer_here(capsys):
    """`afd bench gpu`'s MFA part on the CPU (its smoke test; the figures are a GPU's)."""
    import json

    from afd_cli.main import bench_parser

    args = bench_parser().parse_args(
        ["gpu", "--device", "cpu", "--parts", "mfa", "--mfa-batch", "2", "--context", "20",
         "--repeat-us", "1"]
    )  # fmt: skip
    args.func(args)
    got = json.loads(capsys.readouterr().out.split("\n", 1)[1])["mfa_layer"]
    assert got["shape"]["hidden"] == 7168 and got["batch"] == 2
    paths = {f"{kv}/{p}" for kv in ("bf16", "fp8") for p in ("triton", "torch")}
    assert set(got["layer_us"]) == paths and min(got["layer_us"].values()) > 0


def test_attention_servers_sharing_one_gpu_split_its_memory(monkeypatch):
    from afd_cli import cluster

    monkeypatch.setattr(cluster, "one_gpu", lambda attention, ffn: True)  # as on a 1-GPU host
    plan = {c.name: c.argv for c in Cluster(ClusterConfig(attention=3)).plan()}
    argv = plan["attention-0"]
    assert "inproc://" in argv[argv.index("--ffn") + 1]  # auto: one process per server
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.3000"
    given = ClusterConfig(attention=2, engine_args=("--gpu-memory-utilization", "0.4"))
    argv = {c.name: c.argv for c in Cluster(given).plan()}["attention-1"]
    assert argv.count("--gpu-memory-utilization") == 1  # the user's share is each server's


def test_served_model_name_reaches_the_gateway():
    cluster = Cluster(ClusterConfig(served_model_name=("my-moe", "gpt-4o")))
    (gw,) = [c.argv for c in cluster.plan() if c.name == "gateway"]
    at = gw.index("--served-model-name")
    assert gw[at + 1 : at + 3] == ["my-moe", "gpt-4o"]
    assert cluster.model_name == "my-moe"
    from afd_cli.serve import add_parser as serve_parser  # the flag takes several names

    parser = argparse.ArgumentParser()
    serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ("a", "b")
    plain = Cluster(ClusterConfig())
    assert all("--served-model-name" not in c.argv for c in plain.plan())
