"""The attention server's hand-off of token events from the engine thread to its asyncio loop
(services/attention/server.py: _Mailbox, woken through _PipeWaker or call_soon_threadsafe):
every event arrives, in order, however the posts and the loop's wake-ups interleave."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.attention import server


@pytest.mark.parametrize("pipe", [True, False])
def test_every_event_posted_from_another_thread_arrives_in_order(monkeypatch, pipe):
    if not pipe:  # the fallback where libc cannot be called with the GIL held
        monkeypatch.setattr(server._PipeWaker, "make", classmethod(lambda cls, aio, cb: None))

    async def main() -> list[int]:
        aio = asyncio.get_running_loop()
        box = server._Mailbox(aio)
        assert (box._wake is not None) == pipe
        got: asyncio.Queue[int] = asyncio.Queue()
        n = 2000

        def engine() -> None:  # bursts of posts, some while the loop is delivering
            for i in range(n):
                box.post(got, i)
                if i % 7 == 0:
                    threading.Event().wait(0.0002)

        t = threading.Thread(target=engine)
        t.start()
        out = [await asyncio.wait_for(got.get(), 10) for _ in range(n)]
        t.join()
        return out

    assert asyncio.run(main()) == list(range(2000))
