"""Soak: many concurrent streaming clients for a fixed time against a real local cluster, with
an FFN server killed and restarted in the middle (the one shard without a replica: its streams
pause until it is back) and a replica killed and restarted too; some clients hang up
mid-stream. Nothing may be lost (every request ends answered in full, with a typed error, or
hung up by its own client), no KV block may stay in use, and the long-lived processes' open file
descriptors and memory stay within stated bounds.

It is in the slow set (`python -m pytest -q -m slow`): for AFD_SOAK_SECONDS (20 s) and for 5
minutes; AFD_SOAK_CLIENTS sets the clients (16). The default suite's soak is the one on `afd
serve` (test_soak_serve.py); replica failover under load is also in test_faults.py.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.faults.cluster import GRACE_S, HANG_BOUND_S, Cluster, hang_up, stream, tiny_model
from tests.helpers.procs import Procs, open_fds, rss_mb

SECONDS = float(os.environ.get("AFD_SOAK_SECONDS", "20"))
CLIENTS = int(os.environ.get("AFD_SOAK_CLIENTS", "16"))
# Growth from the end of the warm-up (the first quarter, under the same load) to the end, per
# long-lived process (gateway, attention servers), at most. Memory rises by ~50 MB in the first
# seconds of load (allocator caches sized by the largest batches seen) and then stays flat.
FD_GROWTH = 16  # open descriptors
RSS_GROWTH_MB = 64.0  # resident memory


LONG_SECONDS = 300.0  # the slow set's soak: `python -m pytest -q -m slow`


@pytest.mark.parametrize(
    "seconds",
    [
        pytest.param(SECONDS, id="short", marks=[pytest.mark.slow, pytest.mark.timeout(300)]),
        pytest.param(
            LONG_SECONDS,
            id="long",
            marks=[pytest.mark.slow, pytest.mark.timeout(LONG_SECONDS * 3 + 120)],
        ),
    ],
)
def test_soak_with_ffn_restarts(tmp_path, seconds):
    procs = Procs(tmp_path)
    try:
        cluster = Cluster(procs, tiny_model(tmp_path)).start()
        steady = ["gateway", *cluster.attention]
        for _ in range(3):  # warm up every path (and the allocator) before measuring
            assert stream(cluster.url, 30).kind == "ok"
        pids = {n: procs.procs[n].pid for n in steady}
        start = {n: (open_fds(p), rss_mb(p)) for n, p in pids.items()}

        stop_at = time.monotonic() + seconds
        done = threading.Event()  # the clients stop: the run's time is up and the outage is over
        samples: list[tuple[float, dict]] = []  # (seconds in, {process: RSS MB})

        def sample() -> None:
            t0 = time.monotonic()
            while not done.is_set():
                samples.append((time.monotonic() - t0, {n: rss_mb(p) for n, p in pids.items()}))
                time.sleep(max(1.0, seconds / 20))

        threading.Thread(target=sample, daemon=True).start()
        outcomes: Counter = Counter()
        ok_after_outage = [0]  # full answers to requests started once every expert was back
        errors: list[tuple[float, float, str]] = []  # (seconds in at start, at end, detail)
        t_zero = time.monotonic()
        outage = [seconds, 0.0]  # seconds in: ffn1 killed, every expert covered again
        slowest = [0.0]
        tokens = [0]
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not done.is_set():
                t = time.monotonic() - t_zero
                if rng.random() < 0.1:
                    kind = hang_up(cluster.url)
                else:
                    o = stream(cluster.url, rng.randint(8, 64))
                    kind = o.kind if o.kind != "bad" else f"bad: {o.detail}"
                    with lock:
                        slowest[0] = max(slowest[0], o.seconds)
                        tokens[0] += o.tokens if o.kind == "ok" else 0
                        if o.kind == "error":
                            errors.append((t, time.monotonic() - t_zero, o.detail))
                        elif o.kind == "ok" and outage[1] and t > outage[1]:
                            ok_after_outage[0] += 1
                with lock:
                    outcomes[kind] += 1
                if kind == "error":
                    time.sleep(0.05)  # as a client would before retrying; a 503 comes back at once

        with ThreadPoolExecutor(CLIENTS) as ex:
            futs = [ex.submit(client, i) for i in range(CLIENTS)]
            try:
                time.sleep(seconds * 0.25)
                before = {n: (open_fds(p), rss_mb(p)) for n, p in pids.items()}  # warmed up
                time.sleep(seconds * 0.05)
                outage[0] = time.monotonic() - t_zero
                cluster.kill("ffn1")  # the shard without a spare: its requests pause
                time.sleep(1.0)
                cluster.restart("ffn1")
                cluster.wait_ready(30, servers=2)
                outage[1] = time.monotonic() - t_zero  # every expert covered again
                time.sleep(max(0.0, t_zero + seconds * 0.5 - time.monotonic()))
                cluster.kill("ffn0a")  # a replica: failover, nothing lost
                time.sleep(1.0)
                cluster.restart("ffn0a")
                # A slow box may take most of the run to bring ffn1 back: the clients go on for a
                # quarter of the run after the outage, so requests started after it are measured.
                time.sleep(
                    max(
                        0.0,
                        stop_at - time.monotonic(),
                        t_zero + outage[1] + seconds * 0.25 - time.monotonic(),
                    )
                )
            finally:  # the clients stop even where a step above fails: else the pool waits on them
                done.set()
            for f in futs:
                f.result()
        ran = time.monotonic() - t_zero

        cluster.wait_ready(30, servers=2)
        cluster.wait_idle()
        time.sleep(1.0)  # let closed connections settle before counting descriptors
        after = {n: (open_fds(p), rss_mb(p)) for n, p in pids.items()}
        total = sum(outcomes.values())
        # in flight at some moment of the outage: started before it ended, failed after it began
        late = [
            (round(t0, 2), round(t1, 2), d)
            for t0, t1, d in errors
            if not (t0 <= outage[1] and t1 >= outage[0])
        ]
        over_time = [(round(t), {k: round(v) for k, v in r.items()}) for t, r in samples]
        print(
            f"\nsoak: {seconds:.0f} s, {CLIENTS} clients, {total} requests "
            f"(ffn1 down from {outage[0]:.1f} s to {outage[1]:.1f} s; {len(errors)} typed errors, "
            f"{len(late)} outside that window; {ok_after_outage[0]} full answers after it): "
            f"in {ran:.0f} s ({total / ran:.1f}/s, {tokens[0] / ran:.0f} tokens/s): "
            f"{dict(outcomes)}; "
            f"slowest {slowest[0]:.1f} s; fds/RSS MB at start {start}, warmed up {before}, "
            f"at the end {after}; RSS MB over time {over_time}"
        )
        bad = {k: v for k, v in outcomes.items() if k.startswith("bad")}
        assert not bad, bad
        # While the one unreplicated shard is down its streams pause (--ffn-grace): back within
        # the grace period, no request fails at all. Past it, a typed error is the answer only
        # for a request in flight during the outage: one that ends before the kill or starts
        # after the pool covers every expert again (and any request while a replica is down)
        # is answered in full.
        if outage[1] - outage[0] < GRACE_S:
            assert not errors, errors[:10]
        assert not late, late[:10]
        assert ok_after_outage[0] > CLIENTS, (ok_after_outage[0], outcomes)
        assert slowest[0] < HANG_BOUND_S + 64 / 10 + GRACE_S  # paused for ffn1 at most that
        for n in steady:
            fds, rss = after[n][0] - before[n][0], after[n][1] - before[n][1]
            assert fds <= FD_GROWTH, (n, before[n], after[n])
            assert rss <= RSS_GROWTH_MB, (n, before[n], after[n])
    finally:
        procs.stop_all()
