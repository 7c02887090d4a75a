"""The attention server's hand-off of token events from the engine thread to its asyncio loop
(services/attention/server.py: _Mailbox, one wake-up per burst): every event arrives, in order,
however the posts and the loop's wake-ups interleave."""

from __future__ import annotations

import asyncio
import threading

from services.attention import server


def test_every_event_posted_from_another_thread_arrives_in_order():
    async def main() -> list[int]:
        box = server._Mailbox(asyncio.get_running_loop())
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
