"""`afd serve` as a process tree: the inproc transport (FFN shards inside the attention
process), prefixed logs, and no orphans even when the launcher itself is killed with -9."""

import os
import signal
import time

import httpx
import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from tests.system.test_gateway import alive, child_pids, start_serve


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("serve") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )


def test_inproc_cluster_serves_and_dies_with_its_launcher(model):
    proc, url, log = start_serve(model, "--transport", "inproc", "--ffn", "2")
    try:
        pids = child_pids(log)
        assert len(pids) == 2  # attention (holding both FFN shards) + gateway
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
