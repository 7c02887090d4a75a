"""Attention and FFN servers as separate processes over tcp, ipc and grpc, in 1A1F, 1A2F, 2A2F
and 1A3F topologies with S = 1..3 micro-batches: greedy tokens identical to transformers
(float32 compute, fp32 on the wire), and a dead FFN peer is a typed error, not a hang."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from afd.control import pb
from tests.helpers.checkpoints import REFERENCE_CHECKPOINTS, gpt_oss_mxfp4, hf_greedy, hf_model
from tests.helpers.procs import Procs, free_port, generate, wait_attention_ready

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 57)), [7, 7, 7], list(range(100, 119))]
NEW = 10
TORCH_PATH = {"AFD_KERNELS": "torch"}  # native kernels off: the code a GPU executes

# (transport, attention servers, FFN shards, micro-batches); the slow set adds the cases another
# one covers in the default suite (S = 3 in 1A1F: tcp 1A3F; ipc and grpc 1A2F: their 2A2F)
CASES = [
    ("tcp", 1, 1, 1),
    ("tcp", 1, 1, 2),
    pytest.param("tcp", 1, 1, 3, marks=pytest.mark.slow),
    ("tcp", 1, 2, 2),
    ("tcp", 2, 2, 2),
    ("tcp", 1, 3, 3),
    pytest.param("ipc", 1, 2, 2, marks=pytest.mark.slow),
    ("ipc", 2, 2, 3),
    pytest.param("grpc", 1, 2, 2, marks=pytest.mark.slow),
    ("grpc", 2, 2, 1),
]


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    return hf_greedy(hf_model(qwen3_dir, torch.float32), PROMPTS, NEW)


def _ffn_addr(transport: str, tmp, i: int) -> str:
    if transport == "ipc":
        return f"ipc://{tmp}/ffn-{i}.sock"
    return f"{transport}://127.0.0.1:{free_port()}"


def _start_ffn(procs: Procs, model, ffn: list[str], i: int, *extra: str, dtype="float32",
               env=None) -> None:  # fmt: skip
    shard = f"{i}/{len(ffn)}"
    procs.start(
        f"ffn{i}", "ffn", "--model", str(model), "--shard", shard, "--listen", ffn[i],
        "--dtype", dtype, *extra, env=env,
    )  # fmt: skip


def _start_cluster(
    procs: Procs, model, transport, n_att, n_ffn, S, tmp, timeout="20", grace="20", ffn_args=(),
    dtype="float32", env=None, att_args=(),
):  # fmt: skip
    """ffn_args: extra flags for every FFN server, or a list of them, one per server; att_args:
    for every attention server; env: added to every server's environment. float32 sends fp32
    on the wire, bfloat16 bf16."""
    ffn = [_ffn_addr(transport, tmp, i) for i in range(n_ffn)]
    per_server = ffn_args if ffn_args and isinstance(ffn_args[0], tuple) else [ffn_args] * n_ffn
    for i in range(n_ffn):
        _start_ffn(procs, model, ffn, i, *per_server[i], dtype=dtype, env=env)
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
            dtype,
            "--a2f-dtype",
            "fp32" if dtype == "float32" else "bf16",
            "--micro-batches",
            str(S),
            "--kv-cache-gb",
            "0.05",
            "--ffn-timeout",
            timeout,
            "--ffn-grace",
            grace,
            *att_args,
            env=env,
        )
        att.append(addr)
    for j, addr in enumerate(att):
        wait_attention_ready(addr, procs=procs, name=f"att{j}")
    return ffn, att


def _cluster_tokens(
    procs, model, transport, n_att, n_ffn, S, tmp, ffn_args=(), **kw
) -> list[list[int]]:
    _, att = _start_cluster(procs, model, transport, n_att, n_ffn, S, tmp, ffn_args=ffn_args, **kw)
    # All prompts at once, spread over the attention servers: they batch on each server
    # and their FFN messages meet on the shared FFN servers.
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        futs = [ex.submit(generate, att[i % n_att], p, NEW) for i, p in enumerate(PROMPTS)]
        return [f.result()[0] for f in futs]


@pytest.mark.parametrize("transport,n_att,n_ffn,S", CASES, ids=lambda v: str(v))
def test_topology_matches_transformers(qwen3_dir, reference, tmp_path, transport, n_att, n_ffn, S):
    procs = Procs(tmp_path)
    try:
        assert _cluster_tokens(procs, qwen3_dir, transport, n_att, n_ffn, S, tmp_path) == reference
    finally:
        procs.stop_all()


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_1a2f_over_tcp_matches_transformers(family, tmp_path):
    """MLA's latent cache (and V3.2's indexer pool) on the attention server, the experts and
    shared expert split over two FFN servers: the router's ids and weights are all that
    crosses the wire. (gpt-oss: the MXFP4 test below.) On the torch path (AFD_KERNELS=torch):
    the code a GPU runs."""
    path = REFERENCE_CHECKPOINTS[family](tmp_path / "ckpt")
    ref = hf_greedy(hf_model(path, torch.float32), PROMPTS, NEW)
    procs = Procs(tmp_path)
    try:
        got = _cluster_tokens(procs, path, "tcp", 1, 2, 2, tmp_path, env=TORCH_PATH)
        assert got == ref
    finally:
        procs.stop_all()


def test_bf16_torch_path_1a2f_gives_the_in_process_tokens(qwen3_dir, tmp_path):
    """bf16 on the torch path (AFD_KERNELS=torch: grouped experts, torch attention, as on a
    GPU) with bf16 on the wire: two FFN processes over tcp give exactly the tokens of the
    same path in one process, whose closeness to transformers test_engine_reference checks."""
    from afd.kernels import paths
    from tests.integration.test_engine_reference import PROMPTS as P
    from tests.integration.test_engine_reference import afd_greedy, engine_cfg

    with paths.use("torch"):
        want, _ = afd_greedy(engine_cfg(qwen3_dir, dtype="bfloat16", S=2), num_ffn=2)
    assert _bf16_cluster_tokens(qwen3_dir, 2, 2, tmp_path, TORCH_PATH, P) == want


def _bf16_cluster_tokens(model, n_ffn: int, S: int, tmp_path, env, prompts) -> list[list[int]]:
    """16 greedy tokens a prompt from one attention server and n_ffn FFN processes over tcp,
    bf16 on the wire."""
    procs = Procs(tmp_path)
    try:
        _, att = _start_cluster(procs, model, "tcp", 1, n_ffn, S, tmp_path, dtype="bfloat16",
                                env=env)  # fmt: skip
        with ThreadPoolExecutor(len(prompts)) as ex:
            return [f.result()[0] for f in [ex.submit(generate, att[0], p, 16) for p in prompts]]
    finally:
        procs.stop_all()


@pytest.mark.parametrize("ckpt", ["deepseek_dir", "dsa_dir"])
def test_bf16_fused_mla_1a1f_over_tcp_gives_the_in_process_tokens(
    ckpt, request, tmp_path, monkeypatch
):
    """DeepSeek at dims MLA's fused layer takes, bf16 on this machine's own kernel path and on
    the wire: the attention server's fused MLA layers (mla_layer.c; V3.2's with its indexer's
    selection) with an FFN process over tcp (the shared expert in mlp.c's call) give exactly
    the tokens of one process, where the decode stack runs the same calls;
    test_deepseek_reference checks those against transformers. (Two FFN shards would add
    their partial sums in bf16: other bits.)"""
    deepseek_dir = request.getfixturevalue(ckpt)
    from afd.kernels import paths
    from tests.integration.test_engine_reference import PROMPTS as P
    from tests.integration.test_engine_reference import afd_greedy, engine_cfg

    if not paths.active().native:
        pytest.skip("afd's kernels are not built or the CPU lacks AVX2")
    env = {"AFD_ONEDNN_FROM_ROWS": "0"}  # afd's matmuls at every row count, here and there
    monkeypatch.setenv("AFD_ONEDNN_FROM_ROWS", "0")
    want, _ = afd_greedy(engine_cfg(deepseek_dir, dtype="bfloat16", S=1), num_ffn=1)
    assert _bf16_cluster_tokens(deepseek_dir, 1, 1, tmp_path, env, P) == want


def test_gpt_oss_mxfp4_1a2f_over_tcp_matches_transformers(tmp_path):
    """gpt-oss (sinks and sliding windows on the attention server) with its experts in MXFP4
    (the released layout, which transformers dequantizes on load) kept in 4 bits by two FFN
    servers, one on each compute path: direct, and a workspace smaller than a layer's experts."""
    mx, _ = gpt_oss_mxfp4(REFERENCE_CHECKPOINTS["gpt_oss"](tmp_path / "src"), tmp_path)
    ref = hf_greedy(hf_model(mx, torch.float32), PROMPTS, NEW)
    args = [
        ("--expert-compute", "direct"),
        ("--expert-compute", "workspace", "--expert-workspace-mb", "0.1"),
    ]
    procs = Procs(tmp_path)
    try:
        assert _cluster_tokens(procs, mx, "tcp", 1, 2, 2, tmp_path, ffn_args=args) == ref
    finally:
        procs.stop_all()


def test_dead_ffn_is_a_typed_error_after_the_grace_period_then_recovers(
    qwen3_dir, reference, tmp_path
):
    """kill -9 of the only FFN server and no restart: a request waits out --ffn-grace (2 s)
    paused, then fails with a typed error naming the peer; a restarted server is taken back."""
    procs = Procs(tmp_path)
    try:
        ffn, att = _start_cluster(procs, qwen3_dir, "tcp", 1, 1, 2, tmp_path, "3", grace="2")
        assert generate(att[0], PROMPTS[0], NEW)[0] == reference[0]
        procs.stop("ffn0", sig=9)  # kill -9: no goodbye
        t0 = time.monotonic()
        tokens, last = generate(att[0], PROMPTS[1], NEW, timeout=30)
        took = time.monotonic() - t0
        assert last.finish_reason == "error" and last.error_code == pb.ERROR_UNAVAILABLE, last
        assert ffn[0] in last.error, last.error
        assert 2.0 <= took < 10, took  # the grace period waited out, then no hang
        procs.start(
            "ffn0", "ffn", "--model", str(qwen3_dir), "--listen", ffn[0], "--dtype", "float32"
        )
        wait_attention_ready(att[0], timeout=60, procs=procs, name="att0")
        assert generate(att[0], PROMPTS[2], NEW)[0] == reference[2]
    finally:
        procs.stop_all()


LONG = 120  # tokens (the test model's context is 128): a generation a SIGTERM lands inside


def test_sigterm_drains_an_ffn_so_no_timeout_is_waited_out(qwen3_dir, reference, tmp_path):
    """SIGTERM to an FFN server while a generation streams through it: what it holds is
    answered (computed, or while it drains a typed 'draining' error), so the attention server
    moves the shard to the other replica at once and the tokens are still transformers'; no
    FFN timeout (30 s, 15 s per replica) is waited out. With no replica left (and no grace
    period, --ffn-grace 0), a request fails at once with the draining error. Drained servers
    exit 0; a restarted one is taken back."""
    long_ref = hf_greedy(hf_model(qwen3_dir, torch.float32), [PROMPTS[0]], LONG)[0]
    procs = Procs(tmp_path)
    ffn = [_ffn_addr("tcp", tmp_path, i) for i in range(2)]
    ffn_args = ["--model", str(qwen3_dir), "--dtype", "float32", "--drain-timeout", "5"]
    try:
        for i, addr in enumerate(ffn):
            procs.start(f"ffn{i}", "ffn", "--listen", addr, *ffn_args)
        att = f"127.0.0.1:{free_port()}"
        procs.start(
            "att0", "attention", "--model", str(qwen3_dir), "--ffn", "|".join(ffn),
            "--listen", att, "--dtype", "float32", "--a2f-dtype", "fp32",
            "--kv-cache-gb", "0.05", "--ffn-timeout", "30", "--ffn-grace", "0",
        )  # fmt: skip
        wait_attention_ready(att, procs=procs, name="att0")
        assert generate(att, PROMPTS[1], NEW)[0] == reference[1]  # on ffn0, the first replica

        tokens, t0 = [], 0.0
        for ev in _stream(att, PROMPTS[0], LONG):
            tokens += list(ev.token_ids)
            if not t0 and len(tokens) >= 20:  # mid-stream: ~100 tokens still to come
                t0 = time.monotonic()
                procs.procs["ffn0"].send_signal(signal.SIGTERM)
        assert t0 and tokens == long_ref and ev.finish_reason == "length"
        assert time.monotonic() - t0 < 10  # not a 15 s attempt timeout
        assert procs.procs["ffn0"].wait(timeout=20) == 0

        procs.procs["ffn1"].send_signal(signal.SIGTERM)  # the shard's last replica
        time.sleep(1.0)  # inside its 5 s drain
        t0 = time.monotonic()
        tokens, last = generate(att, PROMPTS[2], NEW, timeout=30)
        assert last.finish_reason == "error" and "draining" in last.error, last
        assert time.monotonic() - t0 < 5
        assert procs.procs["ffn1"].wait(timeout=20) == 0

        procs.start("ffn0", "ffn", "--listen", ffn[0], *ffn_args)
        wait_attention_ready(att, timeout=60, procs=procs, name="att0")
        assert generate(att, PROMPTS[3], NEW)[0] == reference[3]
    finally:
        procs.stop_all()


def _stream(addr: str, prompt: list[int], max_tokens: int):
    """The events of one Generate call, as they come."""
    from afd.control import pb, pb_grpc

    with grpc.insecure_channel(addr) as ch:
        req = pb.GenerateRequest(
            request_id=f"t-{time.monotonic_ns()}",
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        yield from pb_grpc.AttentionServiceStub(ch).Generate(req, timeout=60)


@pytest.mark.parametrize(
    "transport,how",
    [
        ("tcp", "kill"),
        pytest.param("tcp", "stop", marks=pytest.mark.slow),  # the slow set: -m slow
        pytest.param("grpc", "kill", marks=pytest.mark.slow),
        pytest.param("grpc", "stop", marks=pytest.mark.slow),
    ],
    ids=lambda v: v,
)
def test_a_dead_or_hung_ffn_is_noticed_in_seconds_not_at_the_ffn_timeout(
    qwen3_dir, tmp_path, transport, how
):
    """kill -9 (the connection closes) or, over ZeroMQ, SIGSTOP (its heartbeats go
    unanswered) of the one FFN server while a generation streams through it, with the default
    30 s FFN timeout and no grace period (--ffn-grace 0): the stream ends with a typed error
    within seconds, named by the lost connection, not by a deadline waited out; a restarted
    server is taken back. A SIGSTOPped gRPC peer keeps its connection (grpcio's keepalive pings
    stop once no data arrives) and is found by the deadline learnt from its round trips."""
    procs = Procs(tmp_path)
    try:
        ffn, att = _start_cluster(procs, qwen3_dir, transport, 1, 1, 1, tmp_path, "30", grace="0")
        tokens, t0, last = [], 0.0, None
        for ev in _stream(att[0], PROMPTS[0], LONG):
            tokens += list(ev.token_ids)
            last = ev
            if not t0 and len(tokens) >= 10:
                t0 = time.monotonic()
                sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
                procs.procs["ffn0"].send_signal(sig)
        took = time.monotonic() - t0
        assert t0 and last.finish_reason == "error" and last.error_code
        if transport == "grpc" and how == "stop":  # the connection stays up: the deadline
            # learnt from its round trips (deadlines.py), not the 30 s FFN timeout
            assert "within 2.0s" in last.error, last.error
        else:
            assert "is gone" in last.error, last.error  # the lost connection, not a deadline
        assert took < 8, took  # the closed connection, ZeroMQ's heartbeats (~1.5 s) or the
        # learnt deadline (2 s), not 30 s
        if how == "stop":
            procs.procs["ffn0"].send_signal(signal.SIGKILL)
        procs.procs["ffn0"].wait(timeout=10)
        procs.start(
            "ffn0", "ffn", "--model", str(qwen3_dir), "--listen", ffn[0], "--dtype", "float32"
        )
        wait_attention_ready(att[0], timeout=60, procs=procs, name="att0")
        assert generate(att[0], PROMPTS[2], NEW)[1].finish_reason == "length"
    finally:
        procs.stop_all()


RESUMED = 80  # tokens per stream of the restart drill (its prompts' lengths + 80 < 128)


def test_streams_pause_across_an_ffn_restart_and_keep_transformers_tokens(qwen3_dir, tmp_path):
    """kill -9 of one of two FFN shards (no replica) while three generations stream, restarted
    a second later, default --ffn-grace: the streams stop (their KV cache kept), resume when the
    shard is back and end with transformers' greedy tokens, the step in flight at the kill run
    again; a request sent during the outage is served after it."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    ref = hf_greedy(hf_model(qwen3_dir, torch.float32), [*prompts, PROMPTS[1]], RESUMED)
    procs = Procs(tmp_path)
    try:
        ffn, att = _start_cluster(procs, qwen3_dir, "tcp", 1, 2, 2, tmp_path, timeout="30")
        got: list[list[int]] = [[] for _ in prompts]
        stamps: list[list[float]] = [[] for _ in prompts]
        ends: list = [None] * len(prompts)

        def consume(i: int) -> None:
            for ev in _stream(att[0], prompts[i], RESUMED):
                got[i] += list(ev.token_ids)
                stamps[i].append(time.monotonic())
                ends[i] = ev

        with ThreadPoolExecutor(len(prompts) + 1) as ex:
            futs = [ex.submit(consume, i) for i in range(len(prompts))]
            while len(got[0]) < 10:  # mid-stream: ~70 tokens still to come on every stream
                # a failure says how the stream ended (its last event, its tokens) and the log
                assert not futs[0].done(), (futs[0].result(), ends[0], got[0], procs.log("att0"))
                time.sleep(0.005)
            procs.stop("ffn1", sig=signal.SIGKILL)
            killed = time.monotonic()
            during = ex.submit(generate, att[0], PROMPTS[1], RESUMED)
            time.sleep(1.0)
            _start_ffn(procs, qwen3_dir, ffn, 1)
            for f in futs:
                f.result()
            late = during.result()
        log = procs.log("att0")
        assert "pausing" in log and "resuming" in log, log
        for i in range(len(prompts)):
            assert ends[i].finish_reason == "length" and not ends[i].error, ends[i]
            assert got[i] == ref[i], i
            gaps = [b - a for a, b in zip(stamps[i], stamps[i][1:], strict=False)]
            assert 1.0 < max(gaps) < 20.0, gaps  # paused across the restart, within the grace
        assert stamps[0][-1] > killed + 1.0
        assert late[1].finish_reason == "length" and late[0] == ref[-1]
    finally:
        procs.stop_all()


def test_cached_prefixes_1a2f_over_tcp_match_transformers(tmp_path):
    """Prefix caching in a disaggregated cluster: prompts sharing a system prompt (the first
    alone, then the rest at once) find its blocks on the attention server and still give
    transformers' tokens; each request's last event says how many prompt tokens were cached.
    DeepSeek-V3.2: the cached blocks hold MLA's latent and the indexer's keys (every family
    is checked in process, tests/integration/test_prefix_caching.py)."""
    family = "deepseek_v32"
    from tests.integration.test_prefix_caching import PROMPTS as SHARED

    path = REFERENCE_CHECKPOINTS[family](tmp_path / "ckpt")
    ref = hf_greedy(hf_model(path, torch.float32), SHARED, NEW)
    procs = Procs(tmp_path)
    try:
        _, att = _start_cluster(procs, path, "tcp", 1, 2, 2, tmp_path)
        first = generate(att[0], SHARED[0], NEW)
        with ThreadPoolExecutor(len(SHARED) - 1) as ex:
            rest = list(ex.map(lambda p: generate(att[0], p, NEW), SHARED[1:]))
        runs = [first, *rest]
        assert [toks for toks, _ in runs] == ref
        cached = [last.cached_tokens for _, last in runs]
        # block size 16: the 23-token system prompt has one full block
        assert cached[0] == 0 and cached[1] == 16 and cached[4] == 16 and sum(cached) == 48
    finally:
        procs.stop_all()


def test_speculative_decoding_1a2f_over_tcp_matches_transformers(tmp_path):
    """--speculative-config on an attention server whose experts are on two FFN servers: a
    step's drafts travel to the experts as tokens like any other; the greedy tokens are
    transformers', and some events carry several tokens (drafts were kept)."""
    from afd.control import pb_grpc
    from tests.integration.test_speculative import PROMPTS as REPEATING

    path = REFERENCE_CHECKPOINTS["qwen3_moe"](tmp_path / "ckpt")
    ref = hf_greedy(hf_model(path, torch.float32), REPEATING, NEW)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    procs = Procs(tmp_path)
    try:
        _, att = _start_cluster(
            procs, path, "tcp", 1, 2, 1, tmp_path, att_args=("--speculative-config", spec)
        )
        got, sizes = [], []
        with grpc.insecure_channel(att[0]) as ch:
            stub = pb_grpc.AttentionServiceStub(ch)
            for i, prompt in enumerate(REPEATING):
                req = pb.GenerateRequest(
                    request_id=f"spec-{i}",
                    prompt_token_ids=prompt,
                    sampling=pb.SamplingParams(max_tokens=NEW, ignore_eos=True),
                )
                events = list(stub.Generate(req, timeout=60))
                got.append([t for ev in events for t in ev.token_ids])
                sizes += [len(ev.token_ids) for ev in events]
        assert got == ref
        assert max(sizes) > 1
    finally:
        procs.stop_all()
