"""Abort on every path frees the request's KV blocks at once, and ids that are late, unknown or
aborted twice are ignored: the engine loop keeps serving (an in-process cluster, tiny model)."""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future

import pytest

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd.demo import TINY_CONFIG, write_step3_checkpoint
from afd_cli.local import local_engine
from services.attention.loop import EngineLoop

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    path = write_step3_checkpoint(
        tmp_path_factory.mktemp("abort") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )
    cfg = EngineConfig(
        model=ModelConfig.from_hf(path),
        dtype="float32",
        a2f_dtype="fp32",
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=1),  # a second request waits
    )
    with local_engine(cfg, 2, progress=False) as engine:
        lp = EngineLoop(engine)
        yield lp
        lp.close()


def _events():
    q: queue.SimpleQueue = queue.SimpleQueue()
    return q, q.put


def _first(q, timeout=10.0):
    return q.get(timeout=timeout)


def _until(cond, timeout=10.0):
    """Poll instead of sleeping a fixed time: the engine thread applies a submit between steps,
    which on a loaded box can take longer than any fixed pause."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _no_leftovers(loop):
    """A failed test aborts what it left running, so the next one starts on an idle engine."""
    yield
    for rid in ("run", "wait", "dup", "short", "after"):
        loop.abort(rid).result(5)
    _wait_free(loop, timeout=10.0)


def _wait_free(loop, timeout=5.0):
    blocks = loop.engine.blocks
    deadline = time.monotonic() + timeout
    while blocks.num_free_blocks != blocks.num_blocks:
        assert time.monotonic() < deadline, f"{blocks.num_used_blocks} KV blocks still held"
        time.sleep(0.01)


def test_abort_of_a_running_and_a_waiting_request_frees_their_blocks(loop):
    running_q, running_sink = _events()
    waiting_q, waiting_sink = _events()
    loop.submit("run", list(range(1, 40)), LONG, running_sink)
    assert _first(running_q).token_ids  # generating: holds blocks
    loop.submit("wait", list(range(1, 40)), LONG, waiting_sink)
    _until(lambda: loop.engine.load().waiting == 1)
    assert loop.engine.load().kv_usage > 0
    assert loop.abort("wait").result(5) is True  # Abort answers whether it found the request
    assert loop.abort("run").result(5) is True
    finals = []
    for q in (waiting_q, running_q):
        ev = _first(q)
        while not ev.finish_reason:
            ev = _first(q)
        finals.append(ev.finish_reason)
    assert finals == ["abort", "abort"]
    _wait_free(loop)


def test_late_unknown_and_repeated_ids_are_ignored(loop):
    q, sink = _events()
    loop.submit("short", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), sink)
    while not (ev := _first(q)).finish_reason:
        pass
    assert ev.finish_reason == "length"
    for rid in ("short", "short", "never-seen", ""):  # late (finished), twice, unknown
        assert loop.abort(rid).result(5) is False
    # A readiness call whose caller gave up before it ran must not take the loop down either.
    gone: Future = loop.call(lambda: None)
    gone.cancel()
    q, sink = _events()
    loop.submit("after", [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True), sink)
    while not (ev := _first(q)).finish_reason:
        pass
    assert ev.finish_reason == "length" and ev.completion_tokens == 3
    assert loop.call(lambda: "alive").result(5) == "alive"
    _wait_free(loop)


def test_a_duplicate_id_is_refused_without_disturbing_the_original(loop):
    q1, s1 = _events()
    q2, s2 = _events()
    loop.submit("dup", list(range(1, 20)), LONG, s1)
    assert _first(q1).token_ids
    loop.submit("dup", [1, 2], LONG, s2)
    ev = _first(q2)
    assert ev.finish_reason == "error" and ev.error_code == "invalid_request"
    loop.abort("dup")
    while not (ev := _first(q1)).finish_reason:
        pass
    assert ev.finish_reason == "abort"
    _wait_free(loop)
