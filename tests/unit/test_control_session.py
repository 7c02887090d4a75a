"""The control plane's Session: the gateway's client and the attention server's servicer over a
real gRPC server, with a stand-in for the engine loop that steps every live request at once
(as the engine thread does: all of a step's events back to back)."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import grpc
import pytest

from afd.control import SamplingParams, pb, pb_grpc
from services.gateway.client import AttentionClient
from services.gateway.errors import APIError, PeerUnavailable
from tests.helpers.control import (
    GenerateOnlyServicer,
    SteppingLoop,
    free_port,
    servicer,
    start_server,
)


async def _tokens(client: AttentionClient, rid: str, n: int) -> tuple[list[int], str]:
    ids, finish = [], ""
    async for ev in client.generate(rid, [1, 2, 3], SamplingParams(max_tokens=n)):
        ids += ev.token_ids
        finish = ev.finish_reason
    return ids, finish


def _run(coro, loop: SteppingLoop, timeout: float = 20.0):
    """Run `coro` to its end (or the timeout), then stop the stand-in engine loop."""
    try:
        return asyncio.run(asyncio.wait_for(coro, timeout))
    finally:
        loop.close()


async def _with_client(control, addr: str, body, **client_args):
    """Serve `control` on `addr` while `body(client)` runs, then close both."""
    server = await start_server(control, addr)
    client = AttentionClient(addr, **client_args)
    try:
        return await body(client)
    finally:
        await client.close()
        await server.stop(None)


def _many(n: int, tokens: int):
    """n requests of `tokens` tokens each, started together on one Session against a stand-in
    loop that steps once all n are in: (each request's (tokens, finish reason), the servicer)."""
    loop = SteppingLoop(start_when=n, step_s=0.02)
    addr = f"127.0.0.1:{free_port()}"
    control = servicer(loop, addr)

    async def body(client):
        return await asyncio.gather(*(_tokens(client, f"r{i}", tokens) for i in range(n)))

    return _run(_with_client(control, addr, body), loop), control


def test_a_step_of_many_requests_is_one_message_and_each_request_gets_its_own_tokens():
    n, tokens = 16, 5
    results, control = _many(n, tokens)
    assert results == [(list(range(tokens)), "length")] * n
    assert sum(control.messages) == n * tokens
    # One message per step, give or take a step split by the loop waking mid-burst; a message
    # per request would be n * tokens of them.
    assert len(control.messages) <= 2 * tokens, control.messages
    assert control.active == 0


async def _aborted(loop: SteppingLoop, rid: str) -> bool:
    for _ in range(100):  # the abort travels on the Session
        if rid in loop.aborted:
            return True
        await asyncio.sleep(0.01)
    return False


def test_closing_a_stream_early_aborts_that_request_only_and_a_gateway_gone_aborts_the_rest():
    loop = SteppingLoop(start_when=2)
    addr = f"127.0.0.1:{free_port()}"
    control = servicer(loop, addr)

    async def body(client):
        other = asyncio.create_task(_tokens(client, "b", 20))
        got = []
        stream = client.generate("a", [1], SamplingParams(max_tokens=1000))
        async with aclosing(stream) as events:
            async for ev in events:
                got += ev.token_ids
                if len(got) == 2:
                    break
        result = await other
        aborted_a = await _aborted(loop, "a")
        aborted_early = list(loop.aborted)
        # The gateway goes away with a request running: the server aborts it.
        stream = client.generate("c", [1], SamplingParams(max_tokens=1000))
        await stream.__anext__()
        await client.close()
        aborted_c = await _aborted(loop, "c")
        await stream.aclose()
        return got, result, aborted_a, aborted_early, aborted_c

    got, other, aborted_a, aborted_early, aborted_c = _run(_with_client(control, addr, body), loop)
    assert got == [0, 1]
    assert other == (list(range(20)), "length")
    assert aborted_a and aborted_early == ["a"]
    assert aborted_c, "the request of a gateway gone was left running"
    assert control.active == 0


def test_a_server_without_session_is_served_by_a_generate_call_per_request_until_upgraded():
    loop = SteppingLoop()
    addr = f"127.0.0.1:{free_port()}"
    upgraded = servicer(loop, addr)

    async def go():
        server = await start_server(servicer(loop, addr, GenerateOnlyServicer), addr)
        client = AttentionClient(addr)
        try:
            first = await _tokens(client, "a", 3)
            second = await _tokens(client, "b", 4)
            await server.stop(None)  # a rolling upgrade: the old server goes, a new one comes
            with pytest.raises(PeerUnavailable):
                await _tokens(client, "c", 2)
            server = await start_server(upgraded, addr)
            for attempt in range(50):  # the channel reconnects after its backoff
                try:
                    third = await _tokens(client, f"d{attempt}", 2)
                    break
                except PeerUnavailable:
                    await asyncio.sleep(0.1)
            return first, second, third
        finally:
            await client.close()
            await server.stop(None)

    first, second, third = _run(go(), loop)
    assert first == ([0, 1, 2], "length")
    assert second == ([0, 1, 2, 3], "length")
    assert third == ([0, 1], "length")
    assert sum(upgraded.messages) == 2, "the upgraded server was not asked for a Session"


def test_a_broken_session_fails_its_requests_and_the_next_request_opens_a_new_one():
    loop = SteppingLoop()
    addr = f"127.0.0.1:{free_port()}"

    async def go():
        server = await start_server(servicer(loop, addr), addr)
        client = AttentionClient(addr)
        errors = []
        try:

            async def long(rid: str) -> None:
                try:
                    async for _ in client.generate(rid, [1], SamplingParams(max_tokens=10_000)):
                        pass
                except APIError as e:
                    errors.append(e)

            tasks = [asyncio.create_task(long(f"r{i}")) for i in range(3)]
            await asyncio.sleep(0.2)
            await server.stop(None)  # the process going away, as the gateway sees it
            await asyncio.gather(*tasks)
            server = await start_server(servicer(loop, addr), addr)
            return errors, await _tokens(client, "after", 3)
        finally:
            await client.close()
            await server.stop(None)

    errors, after = _run(go(), loop)
    assert len(errors) == 3
    assert all(isinstance(e, PeerUnavailable) and e.status == 503 for e in errors)
    assert after == ([0, 1, 2], "length")


def test_a_request_past_its_deadline_is_a_504_and_is_aborted_on_the_server():
    loop = SteppingLoop(start_when=2)  # one request never starts: no event comes
    addr = f"127.0.0.1:{free_port()}"

    async def body(client):
        t0 = time.monotonic()
        with pytest.raises(APIError) as caught:
            await _tokens(client, "slow", 3)
        took = time.monotonic() - t0
        return caught.value, took, await _aborted(loop, "slow")

    control = servicer(loop, addr)
    error, took, aborted = _run(_with_client(control, addr, body, generate_timeout_s=0.3), loop)
    assert error.status == 504 and "did not answer in time" in error.message
    assert took < 2.0
    assert aborted


def test_draining_ends_idle_sessions_and_new_requests_are_refused_with_the_reason():
    loop = SteppingLoop()
    addr = f"127.0.0.1:{free_port()}"
    control = servicer(loop, addr)

    async def body(client):
        before = await _tokens(client, "a", 2)
        still_running = await control.drain(1.0)
        for _ in range(200):
            if not control._sessions:
                break
            await asyncio.sleep(0.01)
        ended = not control._sessions
        with pytest.raises(APIError) as caught:
            await _tokens(client, "b", 2)
        return before, still_running, ended, caught.value

    before, still_running, ended, refused = _run(_with_client(control, addr, body), loop)
    assert before == ([0, 1], "length")
    assert still_running == 0
    assert ended, "an idle Session outlived the drain"
    assert refused.status == 503 and "draining" in refused.message


def test_a_request_id_already_running_on_the_session_is_refused_and_the_first_runs_on():
    loop = SteppingLoop(step_s=0.02)
    addr = f"127.0.0.1:{free_port()}"

    def generate(rid: str, n: int) -> pb.SessionIn:
        sampling = pb.SamplingParams(max_tokens=n, top_p=1.0)
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=[1], sampling=sampling)
        return pb.SessionIn(generate=req)

    async def go():
        server = await start_server(servicer(loop, addr), addr)
        channel = grpc.aio.insecure_channel(addr)
        try:
            sends: asyncio.Queue = asyncio.Queue()

            async def outgoing():
                while (msg := await sends.get()) is not None:
                    yield msg

            call = pb_grpc.AttentionServiceStub(channel).Session(outgoing(), timeout=10)
            sends.put_nowait(generate("x", 4))
            sends.put_nowait(generate("x", 4))
            events = []
            async for msg in call:
                events += msg.events
                if any(ev.finish_reason == "length" for ev in msg.events):
                    sends.put_nowait(None)  # half-close: the server ends the stream
            return events
        finally:
            await channel.close()
            await server.stop(None)

    events = _run(go(), loop)
    refused = [ev for ev in events if ev.error_code == pb.ERROR_INVALID_REQUEST]
    assert len(refused) == 1 and "already running" in refused[0].error
    tokens = [t for ev in events if not ev.error_code for t in ev.token_ids]
    assert tokens == [0, 1, 2, 3]


def test_a_step_too_large_for_one_message_is_split_in_order():
    """A step's events with prompt logprobs can outgrow one message: split at MESSAGE_BYTES,
    in order, one oversized event alone in its own."""
    from afd.control import Logprob, TokenEvent
    from services.attention import session

    def scored(rid: str, n: int) -> TokenEvent:
        lps = [Logprob(i, -1.0, [(i, -1.0), (i + 1, -2.0)]) for i in range(n)]
        return TokenEvent(rid, [7], prompt_logprobs=lps)

    events = [scored("a", 10), TokenEvent("b", [1]), scored("c", 400), scored("d", 10)]
    sizes = [session.event_to_pb(ev).ByteSize() for ev in events]
    cap = sizes[0] + 64 + 1  # "a" and "b" fit together; "c" alone is over the cap
    original = session.MESSAGE_BYTES
    session.MESSAGE_BYTES = cap
    try:
        msgs = list(session.messages(events))
    finally:
        session.MESSAGE_BYTES = original
    assert [[ev.request_id for ev in m.events] for m in msgs] == [["a", "b"], ["c"], ["d"]]
    assert sizes[2] > cap
    assert len(msgs[1].events[0].prompt_logprobs) == 400


def test_the_stream_carries_a_step_split_over_messages(monkeypatch):
    from services.attention import session

    monkeypatch.setattr(session, "MESSAGE_BYTES", 4 * 64)  # four small events a message
    n, tokens = 16, 3
    results, control = _many(n, tokens)
    assert results == [(list(range(tokens)), "length")] * n
    assert max(control.messages) <= 4 and sum(control.messages) == n * tokens
