"""SageMaker's container contract (vLLM serves it too): /ping answers as /ready, and
/invocations serves each body as the endpoint its fields name, behind the API key."""

from __future__ import annotations

from tests.unit.test_gateway_app import FakeClient, make, post, run
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
}


def test_invocations_answer_as_the_endpoint_the_body_names(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient(context=4096)]) as c:
            pairs = [
                ((await post(c, path, body)).json(), (await post(c, "/invocations", body)).json())
                for path, body in BODIES.items()
            ]
            bad = [
                await post(c, "/invocations", {"max_tokens": 4}),
                await c.post("/invocations", content=b"{"),
                await post(c, "/invocations", {"messages": "hi"}),
            ]
            return pairs, bad

    pairs, bad = run(go())
    for own, invoked in pairs:
        assert invoked["object"] == own["object"], (own, invoked)
        drop = {"id", "created", "created_at", "output"}
        assert {k: v for k, v in invoked.items() if k not in drop} == {
            k: v for k, v in own.items() if k not in drop
        }
    assert [p[1]["object"] for p in pairs] == ["chat.completion", "text_completion", "response"]
    assert bad[0].status_code == 400 and bad[0].json()["error"]["code"] == "unknown_invocation"
    assert bad[1].status_code == 400 and bad[1].json()["error"]["code"] == "invalid_json"
    assert bad[2].status_code == 400 and bad[2].json()["error"]["param"] == "messages"


def test_ping_is_readiness_and_public_while_invocations_need_the_key(tokenizer):
    async def go(ready: bool):
        async with make(tokenizer, [FakeClient(ready=ready)], api_key="k", startup_wait_s=0) as c:
            return (
                await c.get("/ping"),
                await c.post("/ping"),
                await post(c, "/invocations", CHAT),
                await post(c, "/invocations", CHAT, headers={"Authorization": "Bearer k"}),
            )

    get, posted, keyless, keyed = run(go(True))
    assert get.status_code == posted.status_code == 200 and get.json()["status"] == "ready"
    assert keyless.status_code == 401 and keyed.status_code == 200
    get, posted, keyless, keyed = run(go(False))
    assert get.status_code == posted.status_code == keyed.status_code == 503
    assert keyless.status_code == 401
