"""`afd serve --elastic-ffn` under 16 streaming clients (real processes): an FFN server added to
a one-server pool through the admin endpoint, computing while it is in, then removed; no request
fails and every stream's text is the one an undisturbed run gives (float32, fp32 wire). (The
original member leaving, which moves the shared expert to another member, is checked in
process: tests/integration/test_elastic_pool.py.)"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from afd_cli.procs import free_port
from tests.system.metrics_helpers import scrape, serve, stream_text, value

pytestmark = pytest.mark.timeout(300)

STREAMS = 16
KEY = "sk-admin-test"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Step-3-shaped: a shared expert and dense layers, which one member of the pool computes
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("elastic") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )


def _stream(url: str, i: int) -> str:
    body = {"prompt": f"story {i}:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    return stream_text(url, body, headers={"Authorization": f"Bearer {KEY}"})


def _clients(url: str, until: threading.Event, results: dict[int, list[str]]) -> None:
    """STREAMS clients, each streaming its prompt again and again until `until` is set."""

    def client(i: int) -> None:
        while True:
            results[i].append(_stream(url, i))
            if until.is_set():
                return

    with ThreadPoolExecutor(STREAMS) as ex:
        for f in [ex.submit(client, i) for i in range(STREAMS)]:
            f.result()  # a failed request fails the test


def test_an_ffn_server_joins_and_leaves_under_load_and_nothing_fails(model):
    admin = free_port()
    served = serve(
        model, "--elastic-ffn", "--ffn", "1", "--admin-port", str(admin), "--api-key", KEY,
        "--dtype", "float32", "--a2f-dtype", "fp32", "--ffn-pool-interval", "0.2",
    )  # fmt: skip
    base = f"http://127.0.0.1:{admin}/admin/ffn"
    head = {"Authorization": f"Bearer {KEY}"}
    try:
        # undisturbed: one round of every stream on the one-server pool
        want = {i: [] for i in range(STREAMS)}
        done = threading.Event()
        done.set()
        _clients(served.url, done, want)

        assert httpx.get(base, timeout=10).status_code == 401  # no key, no admin
        results: dict[int, list[str]] = {i: [] for i in range(STREAMS)}
        stop = threading.Event()
        load = threading.Thread(target=_clients, args=(served.url, stop, results))
        load.start()
        added = httpx.post(base, headers=head, timeout=120)
        assert added.status_code == 201, added.text
        new = added.json()["added"]
        assert [m["name"] for m in httpx.get(base, headers=head).json()["members"]] == [
            "ffn-0",
            new["name"],
        ]
        # the new member computes: its own metrics count the tokens it was sent
        deadline = time.monotonic() + 60
        while value(scrape(new["metrics"]), "afd_ffn_tokens_total") == 0:
            assert time.monotonic() < deadline, "the new FFN server was never sent any work"
            time.sleep(0.2)
        gone = httpx.delete(f"{base}/{new['name']}", headers=head, timeout=120)
        assert gone.status_code == 200, gone.text  # the added server leaves again
        refused = httpx.delete(f"{base}/ffn-0", headers=head, timeout=30)
        assert refused.status_code == 409 and "last FFN server" in refused.text
        time.sleep(1.0)  # the streams run on the one-server pool again for a while
        stop.set()
        load.join(timeout=180)
        assert not load.is_alive()
        for i in range(STREAMS):
            assert results[i] and all(text == want[i][0] for text in results[i]), i
        assert served.proc.poll() is None  # nothing crashed, nothing was restarted
        assert "restarting" not in served.log.read_text()
    finally:
        served.stop()
