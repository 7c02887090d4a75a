"""afd/runtime.py: building on a thread of its own leaves no OpenMP workers behind."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from afd.runtime import on_own_thread


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _new_threads(before: set[int], settled, timeout: float = 5.0) -> set[int]:
    """The threads started since `before` that are still alive, once `settled(them)` holds or
    `timeout` passes. Only new ids count: threads of earlier tests winding down meanwhile (a
    server's daemon threads, say) would move a plain count."""
    end = time.monotonic() + timeout
    while not settled(new := _tids() - before) and time.monotonic() < end:
        time.sleep(0.05)
    return new


def _parallel_matmul() -> torch.Tensor:
    a = torch.randn(768, 768)
    return a @ a  # large enough that ATen runs it as an OpenMP parallel region


needs_two = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
    reason="needs /proc and 2 or more cores (an OpenMP team of one starts no workers)",
)


@needs_two
@pytest.mark.parametrize("build", ["own_thread", "caller"])
def test_a_build_on_its_own_thread_takes_its_openmp_workers_with_it(build):
    """A thread standing in for a server's main thread (it lives on) builds; afterwards the
    process has that thread and nothing else new. Building on the caller instead leaves the
    caller's pool worker: the control case, which proves the count sees it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    built, done, seen = threading.Event(), threading.Event(), []

    def main() -> None:
        out = on_own_thread(_parallel_matmul) if build == "own_thread" else _parallel_matmul()
        seen.append(out.shape)
        built.set()
        done.wait()

    try:
        before = _tids()
        t = threading.Thread(target=main)
        t.start()
        try:
            assert built.wait(30)
            assert seen == [(768, 768)]
            me = {t.native_id}
            if build == "own_thread":
                assert _new_threads(before, lambda new: new == me) == me
            else:
                assert _new_threads(before, lambda new: new > me, timeout=2.0) > me
        finally:
            done.set()
            t.join()
    finally:
        torch.set_num_threads(threads)


def test_on_own_thread_returns_the_value_and_raises_the_error():
    assert on_own_thread(lambda a, b=0: a + b, 2, b=3) == 5
    assert on_own_thread(threading.get_ident) != threading.get_ident()
    with pytest.raises(ValueError, match="bad shard"):
        on_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad shard")))


class _Built(Exception):
    pass


def _record_thread(seen: list):
    def build(*args, **kwargs):
        seen.append(threading.current_thread() is threading.main_thread())
        raise _Built

    return build


def test_the_attention_and_ffn_servers_build_their_engines_off_the_main_thread(monkeypatch):
    """Both servers compute on another thread than the one they start on (the attention
    engine's loop, the FFN listener): each builds its engine on a thread that then ends."""
    from types import SimpleNamespace

    from services.attention import server as attention
    from services.ffn import server as ffn

    seen: list[bool] = []
    monkeypatch.setattr(attention, "Engine", _record_thread(seen))
    monkeypatch.setattr(ffn, "FFNEngine", _record_thread(seen))
    with pytest.raises(_Built):
        attention.serve(SimpleNamespace(engine=None))
    cfg = SimpleNamespace(threads=0, model=None, shard=None, dtype="bfloat16", inject_delay_s=0.0,
                          experts=None, device="cpu")  # fmt: skip
    with pytest.raises(_Built):
        ffn.serve(cfg)
    assert seen == [False, False]
