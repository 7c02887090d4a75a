"""Soak on `afd serve` with default flags, its supervisor doing every restart: streaming clients
for a fixed time while, in turn, an attention server is killed (-9), an FFN server is killed
(-9), an FFN server is stopped (SIGSTOP) and continued 3 s later, and the gateway is restarted
(SIGTERM: it drains and exits, and the supervisor starts it again).

Nothing may be lost: every request ends with all its tokens, with a typed error (the streams
of the killed attention server; 503 while the gateway drains), hung up by its own client, or,
only while the gateway restarts, refused at connect or closed before any response (still in
the backlog of the listener it closed: never read; the client retries). No stream stalls past
the FFN grace period; requests succeed after the last fault with no outside action; at the
end no request is running and no KV block is in use; the processes never restarted keep
their open files, and their memory from the end of the attention outage (when the surviving
server carried every client and its allocator reached its high-water mark) to the end,
within bounds.

Both cases are in the slow set (`python -m pytest -q -m slow`), as the project keeps soaks:
AFD_SERVE_SOAK_SECONDS (30 s) at 16 clients, and 10 minutes at 64. The default suite checks
each kind of restart on its own (tests/system/test_supervision.py, tests/faults/test_faults.py).
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from tests.faults.cluster import GRACE_S, HANG_BOUND_S, hang_up, stream
from tests.helpers.procs import children_of, open_fds, rss_mb
from tests.system.metrics_helpers import serve

SECONDS = float(os.environ.get("AFD_SERVE_SOAK_SECONDS", "30"))
CLIENTS = int(os.environ.get("AFD_SERVE_SOAK_CLIENTS", "16"))
LONG_SECONDS, LONG_CLIENTS = 600.0, 64
FD_GROWTH = 16  # open descriptors, warmed up -> end, per process never restarted
RSS_GROWTH_MB = 64.0


def _gauge(url: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.parametrize(
    "seconds,clients",
    [
        pytest.param(
            SECONDS,
            CLIENTS,
            id="short",
            marks=[pytest.mark.slow, pytest.mark.timeout(SECONDS * 4 + 180)],
        ),
        pytest.param(
            LONG_SECONDS,
            LONG_CLIENTS,
            id="long",
            marks=[pytest.mark.slow, pytest.mark.timeout(LONG_SECONDS * 2 + 300)],
        ),
    ],
)
def test_soak_on_afd_serve_with_every_kind_of_restart(tmp_path, seconds, clients):
    model = write_step3_checkpoint(tmp_path / "tiny", TINY_CONFIG, seed=0, init_std=0.2)
    served = serve(model, "--transport", "tcp", "--attention", "2", "--ffn", "2", timeout=180)
    base = served.url.removesuffix("/v1")
    try:
        parent = served.proc.pid
        ffn, att = children_of(parent, "ffn"), children_of(parent, "attention")
        assert len(ffn) == 2 and len(att) == 2
        for _ in range(3):  # warm every path up before measuring
            assert stream(base, 30).kind == "ok"
        # Never restarted: the supervisor, the second attention server, the SIGSTOPped FFN.
        steady = {"serve": parent, "attention-b": att[1], "ffn-b": ffn[1]}

        outcomes: Counter = Counter()
        bad: list = []
        errors: list[str] = []
        stalls = [0.0]
        ok_after = [0]  # full answers to requests started after the last fault
        last_fault_over = [float("inf")]
        window = [float("inf"), float("inf")]  # the gateway's restart: SIGTERM .. answering again
        # (start, end) of requests refused at connect or closed before any response
        unanswered: list[tuple[float, float]] = []
        done = threading.Event()
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not done.is_set():
                started = time.monotonic()
                if rng.random() < 0.1:
                    kind = hang_up(base)
                else:
                    o = stream(base, rng.randint(8, 64), timeout=120)
                    kind = o.kind
                    with lock:
                        stalls[0] = max(stalls[0], o.stall)
                        if o.kind == "bad":
                            bad.append(o)
                        elif o.kind in ("refused", "dropped"):
                            unanswered.append((started, started + o.seconds))
                        elif o.kind == "error":
                            errors.append(o.detail)
                        elif o.kind == "ok" and started > last_fault_over[0]:
                            ok_after[0] += 1
                with lock:
                    outcomes[kind] += 1
                if kind in ("error", "refused", "dropped"):
                    time.sleep(0.1)  # as a client would before retrying

        t0 = time.monotonic()
        samples: list[tuple[int, dict]] = []  # (seconds in, {process: RSS MB})

        def sample() -> None:
            while not done.wait(max(1.0, seconds / 30)):
                rss = {n: round(rss_mb(p)) for n, p in steady.items()}
                samples.append((round(time.monotonic() - t0), rss))

        threading.Thread(target=sample, daemon=True).start()

        def at(fraction: float) -> None:
            time.sleep(max(0.0, t0 + seconds * fraction - time.monotonic()))

        with ThreadPoolExecutor(clients) as ex:
            futs = [ex.submit(client, i) for i in range(clients)]
            try:
                at(0.15)
                os.kill(att[0], signal.SIGKILL)  # its streams end with a typed error
                at(0.35)  # restarted and taken back by the gateway by now
                before = {n: (open_fds(p), rss_mb(p)) for n, p in steady.items()}
                at(0.4)
                os.kill(ffn[0], signal.SIGKILL)  # its streams pause until the restart is back
                at(0.6)
                os.kill(ffn[1], signal.SIGSTOP)  # hung: the heartbeats mark it down; a pause
                time.sleep(3.0)
                os.kill(ffn[1], signal.SIGCONT)
                at(0.8)
                gateway = children_of(parent, "gateway")[0]
                window[0] = time.monotonic()
                os.kill(gateway, signal.SIGTERM)  # drains, exits 0, and is started again
                deadline = time.monotonic() + 120
                while children_of(parent, "gateway") in ([], [gateway]):
                    assert time.monotonic() < deadline, "the gateway was not restarted"
                    time.sleep(0.1)
                while stream(base, 4).kind != "ok":  # back, and the whole path with it
                    assert time.monotonic() < deadline, "the cluster did not answer again"
                    time.sleep(0.2)
                last_fault_over[0] = window[1] = time.monotonic()
                at(1.0)
                time.sleep(max(0.0, last_fault_over[0] + seconds * 0.1 - time.monotonic()))
            finally:  # the clients stop even where a step above fails: else the pool waits on them
                done.set()
            for f in futs:
                f.result()
        ran = time.monotonic() - t0

        # Nothing left behind on either attention server (the restarted one included).
        deadline = time.monotonic() + 30
        urls = [u for n, u in served.metrics.items() if n.startswith("attention")]
        assert len(urls) == 2, served.metrics
        names = ("afd_num_requests_running", "afd_num_requests_waiting", "afd_kv_cache_usage_perc")
        while any(_gauge(u, g) != 0 for u in urls for g in names):
            assert time.monotonic() < deadline, [(u, [_gauge(u, g) for g in names]) for u in urls]
            time.sleep(0.2)
        time.sleep(1.0)  # let closed connections settle before counting descriptors
        after = {n: (open_fds(p), rss_mb(p)) for n, p in steady.items()}
        log = served.log.read_text()
        total = sum(outcomes.values())
        print(
            f"\nserve soak: {ran:.0f} s, {clients} clients, {total} requests: {dict(outcomes)}; "
            f"{ok_after[0]} full answers after the last fault; longest stall {stalls[0]:.1f} s; "
            f"gateway restart {window[0] - t0:.1f} .. {window[1] - t0:.1f} s; "
            f"typed errors {Counter(e[:60] for e in errors).most_common(4)}; fds/RSS MB "
            f"warmed up {before}, at the end {after}; RSS MB over time {samples}"
        )
        assert not bad, bad[:5]
        # refused or closed unanswered only while the gateway restarts
        outside = [(a - t0, b - t0) for a, b in unanswered if b < window[0] or a > window[1]]
        assert not outside, (outside, window[0] - t0, window[1] - t0)
        assert ok_after[0] >= clients // 2, (ok_after[0], outcomes)
        assert stalls[0] < GRACE_S + HANG_BOUND_S, stalls[0]
        for child in ("ffn-0", "attention-0", "gateway"):
            assert re.search(rf"{child}.* ended \(", log), child  # each restart logged
        for n in steady:
            fds, rss = after[n][0] - before[n][0], after[n][1] - before[n][1]
            assert fds <= FD_GROWTH, (n, before[n], after[n])
            assert rss <= RSS_GROWTH_MB, (n, before[n], after[n])
    finally:
        served.stop()
