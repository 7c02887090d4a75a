"""vLLM's server-wide answers to what a request may ask for itself:
--enable-force-include-usage (every stream ends with its usage) and
--return-tokens-as-token-ids (logprobs name tokens "token_id:N")."""

from __future__ import annotations

from tests.unit.test_gateway_app import FakeClient, make, post, run, sse_events
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture


def _post(tokenizer, path, body, **cfg):
    async def go():
        async with make(tokenizer, [FakeClient(context=4096, text="ab")], **cfg) as c:
            return await post(c, path, body)

    return run(go())


def test_forced_usage_ends_every_stream(tokenizer):
    body = {"prompt": "x", "max_tokens": 2, "stream": True}
    plain = sse_events(_post(tokenizer, "/v1/completions", body).text)
    forced = sse_events(_post(tokenizer, "/v1/completions", body, force_include_usage=True).text)
    assert "usage" not in plain[-1]
    assert forced[-1]["choices"] == [] and forced[-1]["usage"]["completion_tokens"] == 2
    assert all(e["usage"] is None for e in forced[:-1])  # as include_usage has them
    whole = _post(tokenizer, "/v1/completions", {**body, "stream": False}, force_include_usage=True)
    assert whole.json()["usage"]["completion_tokens"] == 2


def test_tokens_as_token_ids_name_every_logprob(tokenizer):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}
    r = _post(tokenizer, "/v1/chat/completions", chat, tokens_as_token_ids=True).json()
    tokens = [e["token"] for e in r["choices"][0]["logprobs"]["content"]]
    assert tokens == [f"token_id:{b}" for b in b"ab"]
    c = _post(tokenizer, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 1},
              tokens_as_token_ids=True).json()  # fmt: skip
    assert c["choices"][0]["logprobs"]["tokens"] == [f"token_id:{b}" for b in b"ab"]
    resp = _post(tokenizer, "/v1/responses", {"input": "x", "max_output_tokens": 2,
                 "top_logprobs": 0}, tokens_as_token_ids=True).json()  # fmt: skip
    part = resp["output"][0]["content"][0]
    assert [e["token"] for e in part["logprobs"]] == [f"token_id:{b}" for b in b"ab"]
