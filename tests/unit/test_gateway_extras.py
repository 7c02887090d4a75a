"""vLLM's smaller request extras through the gateway app: truncate_prompt_tokens,
return_tokens_as_token_ids, stream_options.continuous_usage_stats; and GET /version."""

from __future__ import annotations

from tests.unit.test_gateway_app import FakeClient, make, post, run, sse_events
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture


def _complete(tokenizer, body, fake=None):
    fake = fake or FakeClient(text="abc", finish="stop")

    async def go():
        async with make(tokenizer, [fake]) as c:
            return await post(c, "/v1/completions", {"max_tokens": 3, **body})

    return run(go()), fake


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tokenizer):
    r, fake = _complete(tokenizer, {"prompt": "0123456789", "truncate_prompt_tokens": 4})
    assert r.status_code == 200 and fake.calls[0][1] == tokenizer.encode("6789")
    assert r.json()["usage"]["prompt_tokens"] == 4
    # -1: the model's context (64 tokens here, less room for max_tokens: still a 400)
    long = "x" * 100
    r, fake = _complete(tokenizer, {"prompt": long, "truncate_prompt_tokens": -1, "max_tokens": 1})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r, _ = _complete(tokenizer, {"prompt": long, "truncate_prompt_tokens": 40})
    assert r.status_code == 200
    r, _ = _complete(tokenizer, {"prompt": "abc", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_tokens_as_token_ids_in_logprobs(tokenizer):
    body = {"prompt": "a", "logprobs": 1, "return_tokens_as_token_ids": True}
    lp = _complete(tokenizer, body)[0].json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in b"abc"]
    assert all(
        set(top) == {f"token_id:{t}"} for top, t in zip(lp["top_logprobs"], b"abc", strict=True)
    )
    assert lp["text_offset"] == [0, 1, 2]  # offsets stay in the text

    async def chat():
        async with make(tokenizer, [FakeClient(text="ab", finish="stop")]) as c:
            msgs = [{"role": "user", "content": "x"}]
            body = {"messages": msgs, "max_tokens": 2, "logprobs": True,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            return await post(c, "/v1/chat/completions", body)

    content = run(chat()).json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["token_id:97", "token_id:98"]
    assert bytes(content[0]["bytes"]) == b"token_id:97"


def test_continuous_usage_stats_count_as_the_stream_goes(tokenizer):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    r, _ = _complete(tokenizer, {"prompt": "ab", "stream": True, "stream_options": opts})
    events = sse_events(r.text)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 3 and counts[0] >= 1
    assert all(e["usage"]["prompt_tokens"] == 2 for e in events)
    plain, _ = _complete(
        tokenizer, {"prompt": "ab", "stream": True, "stream_options": {"include_usage": True}}
    )
    assert [e["usage"] for e in sse_events(plain.text)][:-1] == [None] * 3  # only the last


def test_version(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient()]) as c:
            return await c.get("/version")

    r = run(go())
    assert r.status_code == 200 and r.json()["version"] not in ("", None)


def test_bad_words_and_allowed_token_ids_reach_the_engine(tokenizer):
    body = {"prompt": "a", "bad_words": ["ab", " c"], "allowed_token_ids": [97, 98]}
    r, fake = _complete(tokenizer, body)
    assert r.status_code == 200
    sp = fake.calls[0][2]
    # each word as written and after a blank (the demo's tokens are bytes)
    assert sp.bad_words == ((97, 98), (32, 97, 98), (99,), (32, 99))
    assert sp.allowed_token_ids == (97, 98)
    for bad, param in [
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ]:
        r, _ = _complete(tokenizer, {"prompt": "a", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_return_token_ids_whole_and_streamed(tokenizer):
    r, _ = _complete(tokenizer, {"prompt": "hi", "return_token_ids": True})
    (choice,) = r.json()["choices"]
    assert choice["token_ids"] == list(b"abc")
    assert choice["prompt_token_ids"] == tokenizer.encode("hi")
    r, _ = _complete(tokenizer, {"prompt": "hi", "stream": True, "return_token_ids": True})
    chunks = [e["choices"][0] for e in sse_events(r.text) if e["choices"]]
    assert sum((c["token_ids"] for c in chunks), []) == list(b"abc")
    assert chunks[0]["prompt_token_ids"] == tokenizer.encode("hi")
    assert "prompt_token_ids" not in chunks[-1]
    plain, _ = _complete(tokenizer, {"prompt": "hi"})
    assert "token_ids" not in plain.json()["choices"][0]

    async def chat():
        async with make(tokenizer, [FakeClient(text="ab", finish="stop")]) as c:
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                    "return_token_ids": True}  # fmt: skip
            return await post(c, "/v1/chat/completions", body)

    body = run(chat()).json()
    assert body["choices"][0]["token_ids"] == list(b"ab")
    assert body["prompt_token_ids"][0] == tokenizer.encode("<|begin|>")[0]


def test_max_logprobs_bounds_every_count_of_alternatives(tokenizer):
    async def go(body, path="/v1/completions", **cfg):
        async with make(tokenizer, [FakeClient(text="ab", finish="stop")], **cfg) as c:
            return await post(c, path, {"max_tokens": 2, **body})

    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    for body, path, param in [
        ({"prompt": "a", "logprobs": 21}, "/v1/completions", "logprobs"),
        ({"prompt": "a", "prompt_logprobs": 21}, "/v1/completions", "prompt_logprobs"),
        ({**chat, "top_logprobs": 21}, "/v1/chat/completions", "top_logprobs"),
    ]:
        r = run(go(body, path))  # vLLM's default: 20
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "--max-logprobs" in r.json()["error"]["message"]
    r = run(go({**chat, "top_logprobs": 30}, "/v1/chat/completions", max_logprobs=30))
    assert r.status_code == 200
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 30
    r = run(go({"prompt": "a", "logprobs": 300}, max_logprobs=-1))  # the vocabulary's 320
    assert r.status_code == 200
    r = run(go({"prompt": "a", "logprobs": 321}, max_logprobs=-1))
    assert r.status_code == 400


def test_default_chat_template_kwargs_fill_what_a_chat_leaves_out(tmp_path):
    from afd.demo import write_tokenizer
    from afd.tokenizer import ModelTokenizer

    write_tokenizer(tmp_path)
    tok = ModelTokenizer(tmp_path)
    tok.use_chat_template("{{ greeting | default('none') }}:{{ messages[0]['content'] }}")
    defaults = {"greeting": "hey", "other": 1}

    async def go(body, **cfg):
        fake = FakeClient(text="ab", finish="stop")
        async with make(tok, [fake], **cfg) as c:
            msgs = [{"role": "user", "content": "x"}]
            r = await post(c, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **body})
            assert r.status_code == 200, r.text
        return tok.decode(fake.calls[0][1])

    assert run(go({})) == "none:x"
    assert run(go({}, default_chat_template_kwargs=defaults)) == "hey:x"
    mine = {"chat_template_kwargs": {"greeting": "yo"}}
    assert run(go(mine, default_chat_template_kwargs=defaults)) == "yo:x"


def test_reasoning_effort_reaches_the_template(tmp_path):
    from afd.demo import write_tokenizer
    from afd.tokenizer import ModelTokenizer

    write_tokenizer(tmp_path)
    tok = ModelTokenizer(tmp_path)
    tok.use_chat_template("{{ reasoning_effort | default('medium') }}")

    async def go(body):
        fake = FakeClient(text="ab", finish="stop")
        async with make(tok, [fake]) as c:
            msgs = [{"role": "user", "content": "x"}]
            r = await post(c, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **body})
        return r.status_code, tok.decode(fake.calls[0][1]) if fake.calls else r.text

    assert run(go({})) == (200, "medium")
    assert run(go({"reasoning_effort": "high"})) == (200, "high")
    mine = {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert run(go(mine)) == (200, "low")
    assert run(go({"reasoning_effort": "extreme"}))[0] == 400
