"""`afd serve` as a process tree: the inproc transport (FFN shards inside the attention
process), prefixed logs, no orphans even when the launcher itself is killed with -9, and the
priority scheduling policy seen from the API."""

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from services.gateway.client import AttentionClient
from tests.system.test_gateway import alive, attention_addresses, child_pids, start_serve

LONG = 4000  # tokens of the request the others queue behind: seconds of decoding


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = {**TINY_CONFIG, "max_position_embedding": LONG + 96}
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("serve") / "tiny", config, seed=0, init_std=0.2
    )


def test_inproc_cluster_serves_and_dies_with_its_launcher(model):
    proc, url, log = start_serve(
        model, "--transport", "inproc", "--ffn", "2",
        "--scheduling-policy", "priority", "--max-num-seqs", "1",
    )  # fmt: skip
    try:
        pids = child_pids(log)
        assert len(pids) == 2  # attention (holding both FFN shards) + gateway
        _an_urgent_request_is_served_before_an_earlier_one(url, log)
        r = httpx.post(
            f"{url}/completions",
            json={"prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        text = log.read_text()
        assert "[attention-0] " in text and "[gateway] " in text
        os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: the kernel must do it
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "children outlived their launcher"
    finally:
        proc.kill()


def _an_urgent_request_is_served_before_an_earlier_one(url, log):
    """One request at a time (--max-num-seqs 1): while a long one runs, "late" (priority -1)
    is queued after "early" (priority 0) and still finishes first."""
    done: list[str] = []

    def post(name, priority):
        body = {"prompt": name, "max_tokens": 4, "priority": priority, "ignore_eos": True}
        r = httpx.post(f"{url}/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        done.append(name)

    def wait_for(waiting):
        deadline = time.monotonic() + 10
        while (load := stats(log)) != (1, waiting):
            assert time.monotonic() < deadline, f"(running, waiting) is {load}"
            time.sleep(0.02)

    body = {"prompt": "long", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as long:
        lines = long.iter_lines()  # kept: a dropped iterator closes the stream
        first = next(lines)  # it runs
        assert "error" not in first, first
        threads = []
        for waiting, (name, priority) in enumerate((("early", 0), ("late", -1)), start=1):
            threads.append(threading.Thread(target=post, args=(name, priority)))
            threads[-1].start()
            wait_for(waiting)  # queued behind the long one, in this order
        assert not done, "a request ran beside the long one"
    # the long stream closed: aborted, its slot goes to the most urgent
    for t in threads:
        t.join(timeout=60)
    assert done == ["late", "early"]


def stats(log) -> tuple[int, int]:
    """(running, waiting) on the cluster's one attention server."""

    async def ask():
        (address,) = attention_addresses(log)
        c = AttentionClient(address)
        try:
            s = await c.stats()
        finally:
            await c.close()
        return s.running, s.waiting

    return asyncio.run(ask())
