"""The Responses API's stored responses through the gateway app against fake attention
servers: read back, listed, deleted; a conversation going on with previous_response_id; a
background response answered at once, polled, cancelled; the store's byte bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import TypeAdapter

from services.gateway import responses_output
from services.gateway.response_store import ResponseStore, Stored
from tests.unit.test_gateway_app import FakeClient as _Fake
from tests.unit.test_gateway_app import make, post, run
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture
from tests.unit.test_responses_api import CALL, CFG, WEATHER, FakeClient, _events, _response

types = pytest.importorskip("openai.types.responses")
ITEMS = TypeAdapter(list[types.ResponseItem])


class GatedClient(_Fake):
    """Answers only once its gate opens (made in the test's loop)."""

    def __init__(self, **kw):
        super().__init__(context=4096, finish="stop", **kw)
        self.gate: asyncio.Event | None = None

    async def generate(self, request_id, prompt, params):
        async for event in super().generate(request_id, prompt, params):
            await self.gate.wait()
            yield event


def _prompt(tokenizer, fake, k: int = -1) -> str:
    return tokenizer.decode(fake.calls[k][1], skip_special_tokens=False)


def test_stored_response_is_read_listed_and_deleted(tokenizer):
    fake = FakeClient(text="Sunny.")
    body = {"input": [{"role": "user", "content": f"q{k}"} for k in range(5)]}

    async def go():
        async with make(tokenizer, [fake]) as c:
            made = (await post(c, "/v1/responses", {"model": "m", **body})).json()
            rid = made["id"]
            got = await c.get(f"/v1/responses/{rid}")
            pages = [await c.get(f"/v1/responses/{rid}/input_items", params=q) for q in (
                {}, {"order": "asc", "limit": 2}, {"limit": 0}, {"order": "up"},
                {"after": "msg_none"})]  # fmt: skip
            asc = pages[1].json()
            after = await c.get(
                f"/v1/responses/{rid}/input_items",
                params={"order": "asc", "limit": 2, "after": asc["last_id"]},
            )
            unstored = (await post(c, "/v1/responses", {"input": "x", "store": False})).json()
            deleted = await c.delete(f"/v1/responses/{rid}")
            gone = [
                await c.get(f"/v1/responses/{rid}"),
                await c.get(f"/v1/responses/{unstored['id']}"),
                await c.delete(f"/v1/responses/{rid}"),
            ]
            return made, got, pages, after, unstored, deleted, gone

    made, got, pages, after, unstored, deleted, gone = run(go())
    assert made["store"] is True and got.status_code == 200 and got.json() == made
    assert _response(got.json()).output_text == "Sunny."
    listed = ITEMS.validate_python(pages[0].json()["data"])
    assert [i.content[0].text for i in listed] == ["q4", "q3", "q2", "q1", "q0"]  # desc
    asc = pages[1].json()
    assert [i["content"][0]["text"] for i in asc["data"]] == ["q0", "q1"] and asc["has_more"]
    assert [i["content"][0]["text"] for i in after.json()["data"]] == ["q2", "q3"]
    assert [p.status_code for p in pages[2:]] == [400, 400, 400]
    assert unstored["store"] is False
    assert deleted.json() == {"id": made["id"], "object": "response", "deleted": True}
    for r in gone:
        assert r.status_code == 404 and "is stored on this gateway" in r.json()["error"]["message"]


def test_without_a_store_nothing_is_kept_and_background_is_refused(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient()], responses_store_mb=0) as c:
            made = (await post(c, "/v1/responses", {"input": "x"})).json()
            return (
                made,
                await c.get(f"/v1/responses/{made['id']}"),
                await post(c, "/v1/responses", {"input": "x", "background": True}),
            )

    made, got, background = run(go())
    assert made["store"] is False
    assert got.status_code == 404 and "stores no responses" in got.json()["error"]["message"]
    assert background.status_code == 400 and background.json()["error"]["param"] == "background"


def test_previous_response_id_goes_on_with_the_conversation(tokenizer):
    fake = FakeClient(text="Hello Ada.")
    caller = FakeClient(text=CALL)

    async def go():
        async with make(tokenizer, [fake]) as c:
            first = (await post(c, "/v1/responses", {
                "input": "my name is Ada", "instructions": "be brief"})).json()  # fmt: skip
            second = (await post(c, "/v1/responses", {
                "input": "what is my name?", "instructions": "answer in French",
                "previous_response_id": first["id"]})).json()  # fmt: skip
            await post(c, "/v1/responses", {
                "input": "and again?", "previous_response_id": second["id"]})  # fmt: skip
        async with make(tokenizer, [caller], **CFG) as c:
            called = (await post(c, "/v1/responses", {
                "input": "weather in Oslo?", "tools": [WEATHER]})).json()  # fmt: skip
            call = next(i for i in called["output"] if i["type"] == "function_call")
            output = {"type": "function_call_output", "call_id": call["call_id"],
                      "output": '{"temp": 3}'}  # fmt: skip
            await post(c, "/v1/responses", {
                "input": [output], "tools": [WEATHER],
                "previous_response_id": called["id"]})  # fmt: skip

    run(go())
    second, third = _prompt(tokenizer, fake, 1), _prompt(tokenizer, fake, 2)
    order = ["my name is Ada", "Hello Ada.", "what is my name?"]
    assert [second.index(t) for t in order] == sorted(second.index(t) for t in order), second
    # instructions are the request's own, never carried over (as OpenAI's)
    assert "be brief" not in second and "answer in French" in second
    assert "answer in French" not in third
    assert third.index("what is my name?") < third.index("and again?")
    assert third.count("Hello Ada.") == 2  # both earlier answers
    with_output = _prompt(tokenizer, caller)
    for shown in ("weather in Oslo?", '"get_weather"', '{"temp": 3}'):
        assert shown in with_output, (shown, with_output)


def test_a_streamed_response_is_stored_as_it_ended(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient(text="Sunny.")]) as c:
            r = await post(c, "/v1/responses", {"input": "x", "stream": True})
            final = _events(r.text)[-1].response
            return final, (await c.get(f"/v1/responses/{final.id}")).json()

    final, got = run(go())
    assert got["status"] == "completed" and _response(got).output_text == "Sunny."
    assert final.output_text == "Sunny." and got["output"][0]["id"] == final.output[0].id


def test_background_response_is_answered_at_once_then_polled_or_cancelled(tokenizer):
    fake = GatedClient(text="Later.")

    async def go():
        fake.gate = asyncio.Event()
        async with make(tokenizer, [fake]) as c:
            queued = (await post(c, "/v1/responses", {"input": "x", "background": True})).json()
            rid = queued["id"]
            await asyncio.sleep(0.05)
            running = (await c.get(f"/v1/responses/{rid}")).json()
            early = await post(c, "/v1/responses", {"input": "y", "previous_response_id": rid})
            fake.gate.set()
            for _ in range(200):
                done = (await c.get(f"/v1/responses/{rid}")).json()
                if done["status"] not in ("queued", "in_progress"):
                    break
                await asyncio.sleep(0.01)
            fake.gate = asyncio.Event()  # the next one waits forever, until cancelled
            other = (await post(c, "/v1/responses", {"input": "z", "background": True})).json()
            await asyncio.sleep(0.05)
            cancelled = await c.post(f"/v1/responses/{other['id']}/cancel")
            again = await c.post(f"/v1/responses/{other['id']}/cancel")
            fake.gate.set()
            whole = (await post(c, "/v1/responses", {"input": "w"})).json()
            refused = await c.post(f"/v1/responses/{whole['id']}/cancel")
            return queued, running, early, done, cancelled, again, refused

    queued, running, early, done, cancelled, again, refused = run(go())
    assert queued["status"] == "queued" and queued["background"] is True
    assert queued["output"] == [] and _response(queued).status == "queued"
    assert running["status"] == "in_progress"
    assert early.status_code == 400 and "still in_progress" in early.json()["error"]["message"]
    assert done["status"] == "completed" and _response(done).output_text == "Later."
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert again.json()["status"] == "cancelled"
    assert len(fake.closed_early) == 1  # the cancelled generation was stopped
    assert refused.status_code == 400 and "only a background" in refused.json()["error"]["message"]


def test_background_stream_runs_on_when_its_client_leaves_and_is_followed_again(
    tokenizer, monkeypatch
):
    fake = GatedClient(text="Later.")
    body = {"input": "x", "background": True, "stream": True}
    rid = "resp_bg1"  # the client leaves before the event that names it: known beforehand
    monkeypatch.setattr(responses_output, "response_id", lambda: rid)

    async def go():
        fake.gate = asyncio.Event()
        async with make(tokenizer, [fake]) as c:
            left = asyncio.create_task(post(c, "/v1/responses", body))
            await asyncio.sleep(0.05)
            left.cancel()  # the client leaves before a token
            running = (await c.get(f"/v1/responses/{rid}")).json()
            fake.gate.set()
            for _ in range(200):
                if (await c.get(f"/v1/responses/{rid}")).json()["status"] == "completed":
                    break
                await asyncio.sleep(0.01)
            again = await c.get(f"/v1/responses/{rid}", params={"stream": "true"})
            tail = await c.get(
                f"/v1/responses/{rid}", params={"stream": "true", "starting_after": 3}
            )
            bad = await c.get(
                f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "x"}
            )
            monkeypatch.undo()
            whole = (await post(c, "/v1/responses", {"input": "y"})).json()
            unstreamed = await c.get(f"/v1/responses/{whole['id']}", params={"stream": "true"})
            return running, again, tail, bad, unstreamed

    running, again, tail, bad, unstreamed = run(go())
    assert running["status"] == "in_progress" and fake.closed_early == []
    events = _events(again.text)  # every event, in order, as the client's stream helper reads
    assert events[0].type == "response.created" and events[0].response.id == rid
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Later."
    assert [e.sequence_number for e in _events_after(tail.text)] == list(range(4, len(events)))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    assert unstreamed.status_code == 400 and "stream: true" in unstreamed.json()["error"]["message"]


def _events_after(text: str) -> list:
    """A resumed stream's events, each checked against openai's types (from the middle: the
    client's stream helper cannot replay them)."""
    adapter = TypeAdapter(types.ResponseStreamEvent)
    out = []
    for block in (b for b in text.split("\n\n") if b.strip()):
        obj = json.loads(block.split("\n", 1)[1][6:])
        if "response" in obj:
            obj["response"] = _response(obj["response"]).model_dump()
        out.append(adapter.validate_python(obj))
    return out


def _entry(rid: str, text: str, previous: str | None = None, status: str = "completed"):
    return Stored({"id": rid, "status": status, "output": [text]}, [rid], previous)


def test_store_drops_least_recently_used_within_its_budget():
    size = len('{"id":"a","status":"completed","output":["xx"]}["a"]')
    store = ResponseStore(4 * size)  # four entries like these
    for rid, previous in (("a", None), ("b", "a"), ("x", None), ("y", None)):
        store.put(_entry(rid, "xx", previous))
    assert store.used == 4 * size
    # reading b's conversation touches both links, so x is now the least recently used
    assert store.conversation("b") == ["a", "xx", "b", "xx"]
    store.put(_entry("z", "xx"))
    assert sorted(store._entries) == ["a", "b", "y", "z"] and store.used == 4 * size
    store.put(_entry("d", "", "x"))
    with pytest.raises(Exception, match="'x' is stored"):
        store.conversation("d")
    huge = ResponseStore(10)
    huge.put(_entry("only", "z" * 100))
    assert len(huge) == 1  # the newest is never dropped, whatever its size
    huge.put(_entry("next", "z"))
    assert list(huge._entries) == ["next"]
