"""A slow FFN server is found: shard 0 of two gets an injected compute delay
(AFD_FFN_INJECT_DELAY_MS), the attention server decodes through both, and its straggler
detection must flag shard 0, and only shard 0, naming FFN compute as the slow part.

Shard 0 is the harder case: replies are collected in shard order, so without per-arrival
stamps the fast shard's replies, read only after the slow one's, would look just as slow."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from tests.helpers.procs import Procs, free_port, generate, wait_attention_ready
from tests.system.metrics_helpers import hist, scrape, value

DELAY_MS = 15


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("strag") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )


# In the slow set: on a loaded 2-core box the healthy shard's round trips stretch too, and it was
# flagged beside the slow one in 2 of 6 clean-clone runs on 2026-12-02 (it passes alone).
@pytest.mark.slow
def test_the_slow_ffn_shard_is_flagged_with_ffn_compute_named(model, tmp_path):
    procs = Procs(tmp_path)
    ffn = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    side = [free_port() for _ in range(3)]
    try:
        for i, addr in enumerate(ffn):
            procs.start(
                f"ffn{i}",
                *("ffn", "--model", str(model), "--shard", f"{i}/2", "--listen", addr),
                *("--threads", "1", "--metrics-port", str(side[i])),
                env={"AFD_FFN_INJECT_DELAY_MS": str(DELAY_MS)} if i == 0 else {},
            )
        att = f"127.0.0.1:{free_port()}"
        procs.start(
            "att",
            *("attention", "--model", str(model), "--ffn", ",".join(ffn), "--listen", att),
            *("--threads", "1", "--kv-cache-gb", "0.05", "--micro-batches", "2"),
            *("--metrics-port", str(side[2]), "--straggler-factor", "2"),
            *("--straggler-checks", "2", "--straggler-interval", "0.5", "--straggler-window", "5"),
        )
        wait_attention_ready(att, procs=procs, name="att")
        metrics_url = f"http://127.0.0.1:{side[2]}/metrics"

        def flagged() -> float:
            return value(scrape(metrics_url), "afd_ffn_straggler", peer=ffn[0])

        # Decode until the flag is up (or for at most 20 s): ~2 s of traffic are enough.
        deadline = time.monotonic() + 20
        with ThreadPoolExecutor(4) as pool:
            while time.monotonic() < deadline and not flagged():
                list(pool.map(lambda i: generate(att, [5 + i, 9, 17], 24), range(4)))
        samples = scrape(metrics_url)
        assert value(samples, "afd_ffn_straggler", peer=ffn[0]) == 1
        assert value(samples, "afd_ffn_straggler", peer=ffn[1]) == 0
        # The round trip shows it too: shard 0's is longer by about the injected delay.
        slow = hist(samples, "afd_ffn_roundtrip_seconds", peer=ffn[0])
        fast = hist(samples, "afd_ffn_roundtrip_seconds", peer=ffn[1])
        assert slow.mean > fast.mean + 0.8 * DELAY_MS / 1e3
        compute = hist(samples, "afd_ffn_roundtrip_part_seconds", peer=ffn[0], part="ffn_compute")
        assert compute.mean >= DELAY_MS / 1e3
        log = procs.log("att")
        lines = [x for x in log.splitlines() if "is a straggler" in x]
        assert len(lines) == 1, log[-3000:]
        assert "WARNING" in lines[0] and f"FFN peer {ffn[0]} is a straggler" in lines[0]
        assert "slow part: FFN compute" in lines[0]
        # The FFN side agrees: shard 0's layer calls take at least the injected delay.
        f0 = hist(scrape(f"http://127.0.0.1:{side[0]}/metrics"), "afd_ffn_compute_seconds")
        assert f0.mean >= DELAY_MS / 1e3
        assert re.search(
            r"fault injection: AFD_FFN_INJECT_DELAY_MS adds 15.0 ms", procs.log("ffn0")
        )
    finally:
        procs.stop_all()
