"""The code a GPU executes, checked on a CPU: every family's attention side, FFN side and the
dispatcher between them run a prefill and a mixed prefill + decode step with the device side on
PyTorch's `meta` device (tensors with a shape, a dtype and a device, and no data), under a
dispatch mode that holds every op to CUDA's rule: all tensor arguments on one device (a 0-dim
host scalar aside). An op that meets tensors of two devices (a table built on the host, a mask
without `device=`) raises, and so does any value read back to the host inside a layer
(`.item()`, `.tolist()`, `bool(t)`, `nonzero`, `bincount`): each is a sync that stalls a GPU.

The only host <-> device copies are at the boundary (afd/device.py): the dispatcher's `to_host`
and the FFN engine's `to_device`, a copy to the host here made without data (zeros: the CPU
side computes on them) and counted. Each pair of devices across the boundary is run: both on
the device (in one process: no copy to the host at all), attention on the device with experts
on the CPU (the KTransformers-style split), and the reverse. The numbers a GPU gives are
checked on one (tests/gpu); the numbers of this same code on the CPU are checked against
transformers by every reference test on the torch path (AFD_KERNELS=torch) and in float32.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from afd.checkpoint import load_weights
from afd.config import ModelConfig
from afd.device import to_device
from afd.kernels import paths
from afd.sharding import ExpertShard
from afd.transport import FFNServing, connect, listen
from afd.wire import WireLimits
from services.attention import batch
from services.attention.dispatch import FFNDispatcher
from services.attention.kv_cache import KVCache
from services.attention.model import AttentionModel
from services.attention.pipeline import run_layers
from services.attention.replicas import Peer, Replicas
from services.attention.request import Request
from services.attention.scheduler import ScheduledSeq
from services.ffn.engine import FFNEngine
from tests.helpers.checkpoints import REFERENCE_CHECKPOINTS

DEV, CPU = torch.device("meta"), torch.device("cpu")  # DEV: the device without data
BS = 4  # tokens per KV block
PAIRS = {"experts-on-cpu": (DEV, CPU), "attention-on-cpu": (CPU, DEV)}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class OneDevicePerOp(TorchDispatchMode):
    """CUDA's rule on every op: its tensor arguments on one device, a 0-dim host tensor (a
    scalar) aside; copies (`.to`) are how tensors cross."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _COPIES:
            devices = {
                t.device
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)
            }
            if len(devices) > 1:
                raise RuntimeError(f"{func} got tensors on more than one device: {devices}")
        return func(*args, **kwargs)


COPIES_TO_HOST = [0]  # the boundary's device -> host copies in the current run


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The boundary's move; a meta tensor's copy to the host has no data to copy: zeros."""
    if t.device.type == "meta" and device.type == "cpu":
        COPIES_TO_HOST[0] += 1
        return torch.zeros_like(t, device=CPU)
    return to_device(t, device)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {
        family: write(tmp_path_factory.mktemp(family) / "ckpt")
        for family, write in REFERENCE_CHECKPOINTS.items()
    }


def _seq(rid: str, tokens: list[int], start: int, new: int, blocks: list[int]) -> ScheduledSeq:
    req = Request(rid, tokens)
    return ScheduledSeq(req, tokens[start : start + new], start, blocks, sample=True)


def _steps() -> list[list[batch.MicroBatch]]:
    """A prefill of two prompts, then a step of one decode row and a prefill chunk (two
    micro-batches), built on the host as the runner builds them."""
    a, b = list(range(3, 12)), list(range(20, 26))
    first = [_seq("a", a, 0, 9, [0, 1, 2]), _seq("b", b, 0, 6, [3, 4])]
    c = list(range(40, 50))
    second = [_seq("a", a + [7], 9, 1, [0, 1, 2]), _seq("c", c, 4, 6, [5, 6, 7])]
    return [[batch.build(first, BS)], [batch.build([s], BS) for s in second]]


@pytest.fixture(autouse=True)
def host_copies(monkeypatch):
    from services.attention import dispatch
    from services.ffn import engine

    monkeypatch.setattr(dispatch, "to_host", lambda t: _to(t, CPU))
    monkeypatch.setattr(engine, "to_device", _to)
    COPIES_TO_HOST[0] = 0


def _run(
    path, attention_device: torch.device, ffn_device: torch.device, a2f: str, fp8_kv=False
) -> None:
    cfg = ModelConfig.from_hf(path)
    dtype = torch.bfloat16
    w_att = load_weights(cfg, "attention", dtype, None, False)
    w_ffn = load_weights(cfg, "ffn", dtype, ExpertShard(0, 1, cfg.num_experts), False)
    address = f"inproc://meta-{path.parent.name}-{attention_device.type}-{ffn_device.type}-{a2f}"
    # the CPU side on the torch path too: the code a GPU runs, on both sides
    with paths.use("torch"), OneDevicePerOp():
        model = AttentionModel(cfg, dtype, w_att, progress=False, device=attention_device)
        cache = KVCache(model.cache_layout, cfg.num_layers, 8, BS, dtype, attention_device, fp8_kv)
        ffn = FFNEngine(cfg, ExpertShard(0, 1, cfg.num_experts), dtype, w_ffn, False,
                        device=ffn_device)  # fmt: skip
        serving = FFNServing(ffn.compute, WireLimits.for_model(cfg, 64), ffn_device)
        listener = listen(address, serving, inline=True)
        try:
            peer = Peer(connect(address), ExpertShard(0, 1, cfg.num_experts))
            replicas = Replicas(cfg, [peer], 5.0, 0.0)
            ffn_out = FFNDispatcher(cfg, replicas, a2f, dtype, device=attention_device)
            for step in _steps():
                mbs = [batch.to_device(mb, attention_device) for mb in step]
                rows = [mb.sample_rows for mb in mbs]

                def head(m: int, h: torch.Tensor, rows=rows) -> torch.Tensor:
                    return model.logits(h.index_select(0, rows[m]))

                for logits in run_layers(model, cache, ffn_out, mbs, head):
                    assert logits.device == attention_device and logits.dtype == torch.float32
                    assert logits.argmax(dim=-1).device == attention_device  # greedy, on device
        finally:
            listener.close()


@pytest.mark.parametrize("family", list(REFERENCE_CHECKPOINTS))
def test_every_family_runs_on_a_device_without_a_host_sync(ckpts, family):
    _run(ckpts[family], DEV, DEV, "fp8")
    assert COPIES_TO_HOST[0] == 0  # one device, one process: the shard takes its tensors as is


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v32"])
def test_an_fp8_kv_cache_on_a_device_without_a_host_sync(ckpts, family):
    _run(ckpts[family], DEV, DEV, "fp8", fp8_kv=True)


@pytest.mark.parametrize("pair", ["experts-on-cpu", "attention-on-cpu"])
@pytest.mark.parametrize("a2f", ["fp8", "bf16"])
def test_mixed_devices_meet_only_at_the_dispatcher(ckpts, pair, a2f):
    _run(ckpts["qwen3_moe"], *PAIRS[pair], a2f)
    assert COPIES_TO_HOST[0] > 0


def test_planted_host_table_on_the_device_path_is_caught(ckpts, monkeypatch):
    """A mask built on the host (the bug the device= arguments prevent) fails the check."""
    from services.attention import paged_attention as pa

    real = pa._windowed

    def host_mask(bias, positions, window):
        return real(bias, positions, window) + torch.zeros(bias.shape[-1])

    monkeypatch.setattr(pa, "_windowed", host_mask)
    with pytest.raises(Exception, match="device"):
        _run(ckpts["qwen3_moe"], DEV, DEV, "fp8")


def test_planted_host_sync_in_the_experts_is_caught(ckpts, monkeypatch):
    """Counting the pairs per expert on the host (the expert loop's way) fails the check."""
    from services.ffn import experts

    real = experts._grouped

    def counted(x, ids, weights, group, stacked, out):
        ids.reshape(-1).tolist()
        return real(x, ids, weights, group, stacked, out)

    monkeypatch.setattr(experts, "_grouped", counted)
    with pytest.raises(Exception, match="meta tensor"):
        _run(ckpts["qwen3_moe"], DEV, DEV, "fp8")
