"""Faults on a real local cluster: gateway, 2 attention servers, 3 FFN servers (shard 0 on two
replicas, shard 1 on one), separate processes over tcp. Each test kills (-9), stops (SIGSTOP)
or drains a peer while streaming requests are in flight, and checks: every request ends with a
full answer or a typed error (503 / an `unavailable` error event), none past its bound; streams
whose FFN shard went away pause and finish once it is back (--ffn-grace); new requests succeed
once every peer is back; the attention servers end with nothing running and no KV block in use.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.faults.cluster import GRACE_S, HANG_BOUND_S, Cluster, Outcome, stream, tiny_model
from tests.faults.test_fuzz_http import body_strategy, check
from tests.helpers.procs import Procs

CLIENTS = 8
LONG = 300  # tokens: a generation still running when the fault strikes
# Tokens of the streams a drain waits for (or a check of who is busy looks at): near the tiny
# model's 512 positions, so they run for seconds even on a fast box (at 200, two streams took
# 1.3 s on Zen 3, and a faster box finished them, and with them the gateway, before the test
# asked it for a new request).
DRAINED = 480


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    procs = Procs(root)
    try:
        yield Cluster(procs, tiny_model(root)).start()
    finally:
        procs.stop_all()


def _under_fault(cluster: Cluster, fault, tokens: int = LONG, clients: int = CLIENTS):
    """`clients` streams; `fault()` once they are generating; every outcome."""
    with ThreadPoolExecutor(clients) as ex:
        futs = [ex.submit(stream, cluster.url, tokens) for _ in range(clients)]
        time.sleep(0.6)
        fault()
        return [f.result() for f in futs]


def _check(outcomes: list[Outcome], paused: float = 0.0) -> None:
    """Nothing lost or hung: each outcome is an answer or a typed error within its bound
    (`paused`: how long a fault may hold the streams on top of it)."""
    bound = HANG_BOUND_S + LONG / 50 + paused
    bad = [o for o in outcomes if o.kind == "bad" or o.seconds > bound]
    assert not bad, bad


def _report(fault: str, outcomes: list[Outcome], **more) -> None:
    """One line of figures per fault (shown with `pytest -s`)."""
    ok = [o for o in outcomes if o.kind == "ok"]
    err = [o for o in outcomes if o.kind == "error"]
    line = f"\nfault {fault}: {len(ok)}/{len(outcomes)} answered in full, {len(err)} typed errors"
    if err:
        line += f" (the last after {max(o.seconds for o in err):.2f} s)"
    line += "".join(f", {k.replace('_', ' ')} {v:.2f} s" for k, v in more.items())
    print(line)


def _after_recovery(cluster: Cluster, since: float | None = None) -> float:
    """Ready again (both attention servers), serving, idle; seconds since `since`."""
    cluster.wait_ready(30, servers=2)
    outcomes = [stream(cluster.url, 20) for _ in range(3)]
    assert all(o.kind == "ok" for o in outcomes), outcomes
    took = time.monotonic() - since if since is not None else 0.0
    cluster.wait_idle()
    return took


def _draining(cluster: Cluster, within: float = 5.0) -> tuple[int, dict]:
    """/ready once it says draining (a SIGTERM is handled within milliseconds; polling instead of
    sleeping keeps the window short, so a fast box cannot finish the drain before the check)."""
    end = time.monotonic() + within
    while True:
        code, body = cluster.ready()
        if code == 503 or time.monotonic() > end:
            return code, body
        time.sleep(0.02)


def _clamp(body: bytes) -> bytes:
    """Keep a fuzzed body cheap to serve for real: few tokens, few choices."""
    try:
        d = json.loads(body)
    except ValueError:
        return body
    if isinstance(d, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(d.get(key), int) and d[key] > 8:
                d[key] = 8
        if d.get("max_tokens") is None and d.get("max_completion_tokens") is None:
            d["max_tokens"] = 8  # not the whole context
        if isinstance(d.get("n"), int) and d["n"] > 2:
            d["n"] = 2
        if isinstance(d.get("prompt"), list):
            d["prompt"] = d["prompt"][:4]
    return json.dumps(d).encode()


FUZZ_SLOW = 500  # generated bodies per path in the slow set: 1,000 on the real cluster


@pytest.mark.parametrize(
    "examples",
    [
        pytest.param(40, id="ci", marks=pytest.mark.timeout(120)),
        pytest.param(FUZZ_SLOW, id="slow", marks=[pytest.mark.slow, pytest.mark.timeout(1200)]),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fuzzed_requests_on_the_real_cluster_never_5xx(cluster, path, examples):
    spec = httpx.get(f"{cluster.url}/openapi.json", timeout=10).json()
    seen: Counter = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body_strategy(spec, path))
    def one(body: bytes):
        body = _clamp(body)
        r = httpx.post(
            f"{cluster.url}{path}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        seen[r.status_code] += 1
        check(r, body[:200])

    one()
    print(f"\nfuzz {path} on the real cluster: {sum(seen.values())} bodies, statuses {dict(seen)}")
    assert seen[200] and seen[400], seen
    cluster.wait_idle()  # nothing left allocated by any of them


@pytest.mark.timeout(90)
def test_a_replica_killed_mid_stream_loses_no_request_and_is_taken_back(cluster):
    outcomes = _under_fault(cluster, lambda: cluster.kill("ffn0a"))
    assert all(o.kind == "ok" for o in outcomes), outcomes  # failover: nothing lost
    assert cluster.ready()[0] == 200  # shard 0 kept a live replica throughout
    t0 = time.monotonic()
    cluster.restart("ffn0a")
    # Taken back: the first replica is preferred again once a probe finds it answering.
    deadline = time.monotonic() + 30
    while cluster.metric("ffn0a", "afd_ffn_messages_total") == 0:
        assert time.monotonic() < deadline, "the restarted replica was never used again"
        assert stream(cluster.url, 5).kind == "ok"
        time.sleep(0.2)
    back = time.monotonic() - t0
    _after_recovery(cluster)
    slowest = max(o.seconds for o in outcomes)
    _report("kill -9 of a replica", outcomes, slowest_answer=slowest, replica_used_again_after=back)


@pytest.mark.timeout(120)
def test_an_ffn_killed_mid_generation_pauses_its_streams_until_it_is_back(cluster):
    """kill -9 of the shard with no spare, restarted a second later (as `afd serve` would),
    default --ffn-grace: every stream pauses with its KV cache and is answered in full once the
    shard is back; a request sent during the outage waits and is served too."""
    during: list[Outcome] = []

    def fault() -> None:
        cluster.kill("ffn1")
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(stream, cluster.url, 20)
            time.sleep(1.0)
            cluster.restart("ffn1")
            during.append(fut.result())

    t0 = time.monotonic()
    outcomes = _under_fault(cluster, fault)
    _check(outcomes, paused=GRACE_S)
    assert all(o.kind == "ok" for o in outcomes), outcomes
    assert during[0].kind == "ok", during
    back = _after_recovery(cluster, t0)
    _report(
        "kill -9 of an FFN, restarted after 1 s",
        outcomes,
        answered_during_outage_in=during[0].seconds,
        ready_after_kill=back,
    )


@pytest.mark.timeout(120)
def test_a_hung_ffn_pauses_its_streams_until_it_answers_again(cluster):
    """SIGSTOP of the shard with no spare: its ZeroMQ heartbeats go unanswered, so it is marked
    down within seconds and the streams pause; after SIGCONT it is probed back and every
    stream is answered in full."""
    stopped = [0.0]

    def fault() -> None:
        cluster.pause("ffn1")
        try:
            time.sleep(3.0)  # past the heartbeat timeout: the peer is marked down
        finally:
            stopped[0] = time.monotonic()
            cluster.resume("ffn1")

    outcomes = _under_fault(cluster, fault)
    _check(outcomes, paused=GRACE_S)
    assert all(o.kind == "ok" for o in outcomes), outcomes
    back = _after_recovery(cluster, stopped[0])
    _report("SIGSTOP of an FFN for 3 s", outcomes, ready_after_SIGCONT=back)


@pytest.mark.timeout(90)
def test_an_attention_server_killed_mid_stream_fails_only_its_requests(cluster):
    outcomes = _under_fault(cluster, lambda: cluster.kill("att0"))
    _check(outcomes)
    failed = [o for o in outcomes if o.kind == "error"]
    assert failed and all(o.seconds < HANG_BOUND_S for o in failed), failed
    # New requests go to the survivor; the gateway stays ready and says which one is down.
    assert all(stream(cluster.url, 20).kind == "ok" for _ in range(4))
    code, body = cluster.ready()
    assert code == 200 and sorted(s["state"] for s in body["servers"]) == ["down", "ready"]
    t0 = time.monotonic()
    cluster.restart("att0")
    back = _after_recovery(cluster, t0)
    _report("kill -9 of an attention server", outcomes, ready_after_restart=back)
    with ThreadPoolExecutor(4) as ex:  # traffic reaches the restarted server again
        futs = [ex.submit(stream, cluster.url, DRAINED) for _ in range(4)]
        time.sleep(0.5)
        busy = [not isinstance(s, Exception) and s.running > 0 for s in cluster.stats()]
        assert all(f.result().kind == "ok" for f in futs)
    assert all(busy), busy
    cluster.wait_idle()


@pytest.mark.timeout(120)
def test_sigterm_drains_attention_then_gateway_and_both_exit_0(cluster):
    att1 = cluster.procs.procs["att1"]
    with ThreadPoolExecutor(CLIENTS) as ex:
        futs = [ex.submit(stream, cluster.url, DRAINED) for _ in range(4)]
        time.sleep(0.6)
        att1.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        later = [ex.submit(stream, cluster.url, 20) for _ in range(4)]  # go to att0
        outcomes = [f.result() for f in futs + later]
    assert all(o.kind == "ok" for o in outcomes), outcomes  # in-flight ones finished in full
    assert att1.wait(timeout=30) == 0
    _report("SIGTERM of an attention server (drain)", outcomes)

    gateway = cluster.procs.procs["gateway"]
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(stream, cluster.url, DRAINED) for _ in range(2)]
        time.sleep(0.6)
        gateway.send_signal(signal.SIGTERM)
        code, body = _draining(cluster)
        refused = stream(cluster.url, 20)
        # The check below means something only while the drain still waits for the streams.
        still_running = not any(f.done() for f in futs)
        outcomes = [f.result() for f in futs]
    assert all(o.kind == "ok" for o in outcomes), outcomes
    assert still_running, "the streams ended before the gateway was asked for a new one"
    assert refused.kind == "error" and "draining" in refused.detail, refused
    assert code == 503 and body["status"] == "draining"
    assert gateway.wait(timeout=30) == 0
    _report("SIGTERM of the gateway (drain)", outcomes)
    cluster.wait_idle()
