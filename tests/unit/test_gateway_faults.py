"""The gateway when attention servers fail or go away, when it drains itself, and at its input
limits (against fake attention servers: no processes, no model)."""

import asyncio

import pytest

from afd.control import Stats
from afd.demo import write_tokenizer
from afd.tokenizer import ModelTokenizer
from services.gateway.errors import PeerUnavailable, from_attention
from services.gateway.lifecycle import Lifecycle
from tests.unit.test_gateway_app import FakeClient, make, post, run, sse_events

BODY = {"prompt": "x", "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return ModelTokenizer(d)


class Dying(FakeClient):
    """Breaks like a killed process: before any token, or after `after` tokens."""

    def __init__(self, address, after=0, draining=False):
        super().__init__(address)
        self.after, self.draining, self.up = after, draining, True

    async def generate(self, request_id, prompt, params):
        self.calls.append(request_id)
        if self.draining:
            raise from_attention("unavailable", "draining")
        for k, t in enumerate(list(self.text.encode())[: self.after], 1):
            yield type(self).chunk(t, len(prompt), k)
        self.up = False
        raise PeerUnavailable(f"attention server {self.address} is unavailable (UNAVAILABLE)")

    @staticmethod
    def chunk(t, n, k):
        from afd.control import TokenEvent

        return TokenEvent("r", [t], prompt_tokens=n, completion_tokens=k)

    async def stats(self):
        if not self.up:
            raise PeerUnavailable("down")
        return Stats(running=0, waiting=0, kv_usage=0.0, draining=self.draining)

    async def health(self):
        if not self.up:
            raise PeerUnavailable("down")
        return await super().health()


def test_a_dead_server_before_any_token_is_retried_elsewhere_and_marked_down(tokenizer):
    dead, good = Dying("dead:1"), FakeClient("good:1", load=5)  # dead looks idlest

    async def go():
        async with make(tokenizer, [dead, good]) as c:
            await c.get("/ready")
            first = await post(c, "/v1/completions", BODY)
            second = await post(c, "/v1/completions", BODY)
            ready = (await c.get("/ready")).json()
            return first, second, ready

    first, second, ready = run(go())
    assert first.status_code == second.status_code == 200
    assert len(dead.calls) == 1 and len(good.calls) == 2  # marked down after its failure
    assert {s["address"]: s["state"] for s in ready["servers"]} == {
        "dead:1": "down",
        "good:1": "ready",
    }


def test_a_draining_server_is_left_for_another_but_an_ffn_failure_is_not_retried(tokenizer):
    draining, good = Dying("drain:1", draining=True), FakeClient("good:1", load=5)
    ffn_down = FakeClient("ffn:1", error="unavailable")

    async def go():
        async with make(tokenizer, [draining, good]) as c:
            ok = await post(c, "/v1/completions", BODY)
        async with make(tokenizer, [ffn_down, FakeClient("other:1", load=5)]) as c:
            failed = await post(c, "/v1/completions", BODY)
        return ok, failed

    ok, failed = run(go())
    assert ok.status_code == 200 and len(draining.calls) == 1
    # The attention server answered for itself (its FFN pool is down): a typed 503, once.
    assert failed.status_code == 503 and len(ffn_down.calls) == 1


def test_a_server_dying_mid_stream_ends_the_stream_with_an_error_event(tokenizer):
    dead = Dying("dead:1", after=2)

    async def go():
        async with make(tokenizer, [dead, FakeClient("good:1", load=5)]) as c:
            return await post(c, "/v1/completions", {**BODY, "stream": True})

    r = run(go())
    events = sse_events(r.text)
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert r.status_code == 200 and text == "he"
    assert events[-1]["error"]["code"] == "unavailable"
    assert "dead:1" in events[-1]["error"]["message"]


def test_draining_refuses_new_requests_while_those_in_flight_finish(tokenizer):
    slow = FakeClient("slow:1", text="a" * 40)

    async def go():
        async with make(tokenizer, [slow]) as c:
            state = c._transport.app  # the outermost ASGI app: find the lifecycle below
            lifecycle = _lifecycle(state)
            inflight = asyncio.create_task(
                post(c, "/v1/completions", {"prompt": "x", "max_tokens": 40, "stream": True})
            )
            while not lifecycle.inflight:
                await asyncio.sleep(0)
            drained = asyncio.create_task(lifecycle.drain(5.0))
            await asyncio.sleep(0)
            refused = await post(c, "/v1/completions", BODY)
            health, ready = await c.get("/health"), await c.get("/ready")
            return await inflight, refused, health, ready, await drained

    done, refused, health, ready, left = run(go())
    assert done.status_code == 200 and len(sse_events(done.text)) == 40  # finished in full
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    assert health.status_code == 200
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert left == 0


def _lifecycle(app) -> Lifecycle:
    while not hasattr(app, "lifecycle"):
        app = app.app
    return app.lifecycle


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": 17}, "n"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop": "s" * 257}, "stop"),
        ({"max_tokens": 33}, "max_tokens"),  # over --max-tokens-limit
        ({"prompt": ["a"] * 16, "n": 9}, "n"),  # 144 choices in all
    ],
)
def test_limits_are_400s_that_name_the_parameter(tokenizer, body, param):
    async def go():
        async with make(tokenizer, [FakeClient()], max_tokens_limit=32) as c:
            return await post(c, "/v1/completions", {"prompt": "x", **body})

    r = run(go())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == param and err["message"]


def test_a_runaway_chat_template_is_a_400_within_its_time_limit(tokenizer):
    import time

    loop_forever = (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    )
    broken = "{{ messages[0].content + 1 }}"  # a type error in the template
    saved = tokenizer.chat_template
    try:
        results = []
        for template in (loop_forever, broken):
            tokenizer.chat_template, tokenizer._template = template, None

            async def go():
                async with make(tokenizer, [FakeClient()], template_timeout_s=0.3) as c:
                    body = {"messages": [{"role": "user", "content": "hi"}]}
                    t0 = time.monotonic()
                    r = await post(c, "/v1/chat/completions", body)
                    health = await c.get("/health")  # the event loop was never blocked
                    return r, time.monotonic() - t0, health

            results.append(run(go()))
    finally:
        tokenizer.chat_template, tokenizer._template = saved, None
    (slow, took, health), (bad, _, _) = results
    assert slow.status_code == 400 and "within 0.3 s" in slow.json()["error"]["message"]
    assert took < 2 and health.status_code == 200
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_a_body_nested_past_pythons_stack_is_a_400(tokenizer):
    deep = b"[" * 100_000 + b"]" * 100_000

    async def go():
        async with make(tokenizer, [FakeClient()]) as c:
            r = await c.post("/v1/chat/completions", content=b'{"messages": ' + deep + b"}")
            return r, await c.get("/health")

    r, health = run(go())
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert health.status_code == 200
