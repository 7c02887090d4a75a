"""`afd serve` supervises its children (real processes): a `kill -9` of an FFN server or an
attention server once the cluster is up is logged with its cause and restarted on the same
ports, and the cluster answers again with no outside action (streams through a killed FFN
server pause and finish once it is back); a child that keeps dying is a
crash loop, and the cluster stops saying so."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from tests.faults.cluster import GRACE_S
from tests.helpers.procs import children_of
from tests.system.metrics_helpers import serve, stream_text

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("sup") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )


def _child(parent: int, role: str) -> int:
    """The pid of one of `afd serve`'s children running `afd <role>`."""
    found = children_of(parent, role)
    assert found, f"no {role} child of {parent}"
    return found[0]


def _answers(url: str, timeout: float) -> float:
    """Seconds until a completion through the gateway is answered in full."""
    t0 = time.monotonic()
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    while True:
        try:
            r = httpx.post(f"{url}/completions", json=body, timeout=30)
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < timeout, "the cluster did not answer again"
        time.sleep(0.25)


STREAMS = 16


def _stream(url: str, i: int, stamps: list[float]) -> str:
    """One streaming completion's text; the arrival time of each chunk goes to `stamps`."""
    body = {"prompt": f"story {i}:", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    return stream_text(url, body, stamps=stamps)


def _streams(url: str, kill: int | None = None) -> tuple[list[str], list[list[float]]]:
    """STREAMS concurrent streaming completions; with `kill`, SIGKILL that pid once they are
    all generating."""
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    with ThreadPoolExecutor(STREAMS) as ex:
        futs = [ex.submit(_stream, url, i, stamps[i]) for i in range(STREAMS)]
        if kill is not None:
            # every stream under way (one that began late on a loaded box may find another
            # already finished: that one is simply not interrupted), most still generating
            while not all(len(s) >= 3 or f.done() for s, f in zip(stamps, futs, strict=True)):
                time.sleep(0.01)
            assert sum(f.done() for f in futs) < STREAMS // 2, "too few streams left to interrupt"
            os.kill(kill, signal.SIGKILL)
        return [f.result() for f in futs], stamps


def test_killed_children_are_restarted_and_the_cluster_serves_again(model, monkeypatch):
    """An FFN child killed under 16 streams (default flags): the streams pause until the
    supervisor's restart is back and end with the text of an undisturbed run; an attention
    child killed: the cluster answers again once it is restarted."""
    # no AFD_ONEDNN_FROM_ROWS here: on avx512bf16 `afd serve` measures from how many rows
    # oneDNN's matmul (other sums) takes over once and hands the restarted FFN server the
    # number its predecessor had (afd_cli/measured.py); measured by each, 32 and 64 were seen
    monkeypatch.delenv("AFD_ONEDNN_FROM_ROWS", raising=False)
    served = serve(model, "--transport", "tcp", "--ffn", "2")
    try:
        reference = httpx.post(
            f"{served.url}/completions",
            json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=30,
        ).json()["choices"][0]["text"]
        undisturbed, _ = _streams(served.url)
        pid = _child(served.proc.pid, "ffn")
        texts, stamps = _streams(served.url, kill=pid)
        assert texts == undisturbed
        stall = max(b - a for s in stamps for a, b in zip(s, s[1:], strict=False))
        assert 0.5 < stall < GRACE_S, stall  # they did stop, and not for longer than the grace
        ffn = children_of(served.proc.pid, "ffn")
        assert len(ffn) == 2 and pid not in ffn  # a new process, same command line
        pid = _child(served.proc.pid, "attention")
        os.kill(pid, signal.SIGKILL)
        _answers(served.url, timeout=90)
        assert _child(served.proc.pid, "attention") != pid
        assert served.proc.poll() is None  # the cluster kept running
        again = httpx.post(
            f"{served.url}/completions",
            json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=30,
        ).json()["choices"][0]["text"]
        assert again == reference
        log = served.log.read_text()
        assert "ended (killed by SIGKILL); restarting it in" in log
    finally:
        served.stop()


@pytest.mark.slow  # the crash-loop rule itself is unit-tested (tests/unit/test_supervisor.py)
def test_a_crash_loop_stops_the_cluster_with_its_cause(model):
    served = serve(model, "--transport", "tcp", "--max-restarts", "1")
    try:
        os.kill(_child(served.proc.pid, "ffn"), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # wait for the restart, then kill it again
            try:
                pid = _child(served.proc.pid, "ffn")
                break
            except AssertionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        assert served.proc.wait(timeout=120) == 1
        assert "crash-looping" in served.log.read_text()
    finally:
        served.stop()
