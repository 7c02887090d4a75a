"""`afd serve` supervises its children (real processes): a `kill -9` of an FFN server or an
attention server once the cluster is up is logged with its cause and restarted on the same
ports, and the cluster answers again with no outside action; a child that keeps dying is a
crash loop, and the cluster stops saying so."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from tests.system.metrics_helpers import serve

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("sup") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )


def _child(parent: int, role: str) -> int:
    """The pid of `afd serve`'s child running `afd <role>` (its direct child)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and role.encode() in argv:
            return int(d.name)
    raise AssertionError(f"no {role} child of {parent}")


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


def test_killed_children_are_restarted_and_the_cluster_serves_again(model):
    served = serve(model, "--transport", "tcp", "--ffn", "2")
    try:
        reference = httpx.post(
            f"{served.url}/completions",
            json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=30,
        ).json()["choices"][0]["text"]
        for role in ("ffn", "attention"):
            pid = _child(served.proc.pid, role)
            os.kill(pid, signal.SIGKILL)
            _answers(served.url, timeout=90)
            assert _child(served.proc.pid, role) != pid  # a new process, same command line
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
