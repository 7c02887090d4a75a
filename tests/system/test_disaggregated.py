"""Attention and FFN servers as separate processes over tcp, ipc and grpc, in 1A1F, 1A2F, 2A2F
and 1A3F topologies with S = 1..3 micro-batches: greedy tokens identical to transformers
(float32 compute, fp32 on the wire), and a dead FFN peer is a typed error, not a hang."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers.checkpoints import hf_greedy, hf_model
from tests.helpers.procs import Procs, free_port, generate, wait_attention_ready

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 57)), [7, 7, 7], list(range(100, 119))]
NEW = 10

# (transport, attention servers, FFN shards, micro-batches)
CASES = [
    ("tcp", 1, 1, 1),
    ("tcp", 1, 1, 2),
    ("tcp", 1, 1, 3),
    ("tcp", 1, 2, 2),
    ("tcp", 2, 2, 2),
    ("tcp", 1, 3, 3),
    ("ipc", 1, 2, 2),
    ("ipc", 2, 2, 3),
    ("grpc", 1, 2, 2),
    ("grpc", 2, 2, 1),
]


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    return hf_greedy(hf_model(qwen3_dir, torch.float32), PROMPTS, NEW)


def _ffn_addr(transport: str, tmp, i: int) -> str:
    if transport == "ipc":
        return f"ipc://{tmp}/ffn-{i}.sock"
    return f"{transport}://127.0.0.1:{free_port()}"


def _start_cluster(procs: Procs, model, transport, n_att, n_ffn, S, tmp, timeout="20"):
    ffn = [_ffn_addr(transport, tmp, i) for i in range(n_ffn)]
    for i, addr in enumerate(ffn):
        procs.start(
            f"ffn{i}",
            "ffn",
            "--model",
            str(model),
            "--shard",
            f"{i}/{n_ffn}",
            "--listen",
            addr,
            "--dtype",
            "float32",
        )
    att = []
    for j in range(n_att):
        addr = f"127.0.0.1:{free_port()}"
        procs.start(
            f"att{j}",
            "attention",
            "--model",
            str(model),
            "--ffn",
            ",".join(ffn),
            "--listen",
            addr,
            "--dtype",
            "float32",
            "--a2f-dtype",
            "fp32",
            "--micro-batches",
            str(S),
            "--kv-cache-gb",
            "0.05",
            "--ffn-timeout",
            timeout,
        )
        att.append(addr)
    for j, addr in enumerate(att):
        wait_attention_ready(addr, procs=procs, name=f"att{j}")
    return ffn, att


@pytest.mark.parametrize("transport,n_att,n_ffn,S", CASES, ids=lambda v: str(v))
def test_topology_matches_transformers(qwen3_dir, reference, tmp_path, transport, n_att, n_ffn, S):
    procs = Procs(tmp_path)
    try:
        _, att = _start_cluster(procs, qwen3_dir, transport, n_att, n_ffn, S, tmp_path)
        # All prompts at once, spread over the attention servers: they batch on each server
        # and their FFN messages meet on the shared FFN servers.
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            futs = [ex.submit(generate, att[i % n_att], p, NEW) for i, p in enumerate(PROMPTS)]
            got = [f.result()[0] for f in futs]
        assert got == reference
    finally:
        procs.stop_all()


def test_dead_ffn_is_a_typed_error_then_recovers(qwen3_dir, reference, tmp_path):
    procs = Procs(tmp_path)
    try:
        ffn, att = _start_cluster(procs, qwen3_dir, "tcp", 1, 1, 2, tmp_path, timeout="3")
        assert generate(att[0], PROMPTS[0], NEW)[0] == reference[0]
        procs.stop("ffn0", sig=9)  # kill -9: no goodbye
        t0 = time.monotonic()
        tokens, last = generate(att[0], PROMPTS[1], NEW, timeout=30)
        assert last.finish_reason == "error" and "did not reply" in last.error
        assert time.monotonic() - t0 < 10  # the 3 s deadline, not a hang
        procs.start(
            "ffn0", "ffn", "--model", str(qwen3_dir), "--listen", ffn[0], "--dtype", "float32"
        )
        wait_attention_ready(att[0], timeout=60, procs=procs, name="att0")
        assert generate(att[0], PROMPTS[2], NEW)[0] == reference[2]
    finally:
        procs.stop_all()
