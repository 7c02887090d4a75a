"""The gateway app against fake attention servers (no processes, no torch model): response
shapes, SSE framing, stop strings, n/seeds, error mapping, auth, body limit, request ids."""

import asyncio
import json

import httpx
import pytest

from afd.control import Health, Logprob, Stats, TokenEvent
from afd.demo import write_tokenizer
from afd.tokenizer import ModelTokenizer
from services.gateway.app import GatewayConfig, create_app
from services.gateway.balancer import Balancer
from services.gateway.detok import TokenBytes
from services.gateway.errors import from_attention
from services.gateway.handlers import GatewayState

TEXT = "hello world, all good"
KEY = "sk-unit"


class FakeClient:
    """Answers Generate with the bytes of TEXT, one token per event."""

    def __init__(
        self,
        address="fake:1",
        error=None,
        error_after=0,
        ready=True,
        load=0,
        text=TEXT,
        cached=0,
        finish="length",
        context=64,
        ids=None,
        stop_token=False,
    ):
        self.address, self.text, self.cached, self.finish = address, text, cached, finish
        self.context = context  # the model's context length, as Health reports it
        self.ids = ids  # the token ids to answer with (default: TEXT's bytes)
        self.stop_token = stop_token  # the last token is the stop token that ended it
        self.error, self.error_after = error, error_after
        self.ready, self.load = ready, load
        self.calls = []
        self.closed_early = []

    async def generate(self, request_id, prompt, params):
        self.calls.append((request_id, list(prompt), params))
        ids = list(self.text.encode() if self.ids is None else self.ids)[: params.max_tokens]
        done = False
        if not ids:  # max_tokens 0: as the attention server, one event that ends it
            done = True
            yield TokenEvent(request_id, [], [], "length", prompt_tokens=len(prompt))
            return
        try:
            for k, t in enumerate(ids, 1):
                if self.error and k > self.error_after:
                    done = True
                    raise from_attention(self.error, f"fake {self.error}")
                await asyncio.sleep(0)
                want = params.logprobs is not None
                lps = [Logprob(t, -0.5, [(t, -0.5)] * params.logprobs)] if want else []
                finish = self.finish if k == len(ids) else ""
                done = bool(finish)
                yield TokenEvent(
                    request_id,
                    [t],
                    lps,
                    finish,
                    prompt_tokens=len(prompt),
                    completion_tokens=k,
                    cached_tokens=self.cached,
                    stop_token=self.stop_token and bool(finish),
                )
        finally:
            if not done:
                self.closed_early.append(request_id)

    async def health(self):
        return Health(True, self.ready, "" if self.ready else "FFN down", "m", self.context)

    async def stats(self):
        return Stats(running=self.load, waiting=0, kv_usage=0.0)

    async def close(self):
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return ModelTokenizer(d)


def make(tokenizer, clients, **cfg):
    state = GatewayState(tokenizer, TokenBytes(tokenizer), Balancer(clients), "m", 320, "demo!")
    app = create_app(state, GatewayConfig("unused", ("fake:1",), "m", **cfg))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def run(coro):
    return asyncio.run(coro)


async def post(c, path, body, **kw):
    return await c.post(path, json=body, **kw)


def sse_events(text):
    out = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


def test_completion_body_usage_and_request_id(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient()]) as c:
            r = await post(
                c,
                "/v1/completions",
                {"prompt": "abc", "max_tokens": 5},
                headers={"X-Request-Id": "r-1"},
            )
            return r

    r = run(go())
    assert r.status_code == 200 and r.headers["x-request-id"] == "r-1"
    body = r.json()
    assert body["id"] == "cmpl-r-1" and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == TEXT[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_usage_reports_the_prefix_cache_tokens_once_per_prompt(tokenizer):
    """OpenAI's prompt_tokens_details.cached_tokens, from the attention server's count: once
    per distinct prompt however many choices ran it, in bodies and in the stream's usage."""

    async def go():
        async with make(tokenizer, [FakeClient(cached=2)]) as c:
            whole = await post(c, "/v1/completions", {"prompt": "abc", "max_tokens": 3, "n": 3})
            opts = {"stream": True, "stream_options": {"include_usage": True}}
            msgs = [{"role": "user", "content": "hi"}]
            body = {"model": "m", "messages": msgs, "max_tokens": 3, **opts}
            streamed = await post(c, "/v1/chat/completions", body)
            return whole.json(), sse_events(streamed.text)

    whole, events = run(go())
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_chat_stream_framing_matches_non_stream(tokenizer):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    async def go():
        async with make(tokenizer, [FakeClient()]) as c:
            whole = await post(c, "/v1/chat/completions", req)
            opts = {"stream": True, "stream_options": {"include_usage": True}}
            streamed = await post(c, "/v1/chat/completions", {**req, **opts})
            return whole, streamed

    whole, streamed = run(go())
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole.json()["choices"][0]["message"]["content"] == TEXT[:8]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_stop_string_cuts_the_text_and_cancels_the_generation(tokenizer):
    fake = FakeClient()

    async def go():
        async with make(tokenizer, [fake]) as c:
            body = {"prompt": "x", "max_tokens": 20, "stop": ["o w", "zzz"], "stream": True}
            return await post(c, "/v1/completions", body)

    events = sse_events(run(go()).text)
    assert "".join(e["choices"][0]["text"] for e in events) == "hell"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert fake.closed_early == [fake.calls[0][0]]  # the attention call was cancelled


def test_n_choices_get_distinct_ids_and_consecutive_seeds(tokenizer):
    fake = FakeClient()

    async def go():
        async with make(tokenizer, [fake]) as c:
            body = {"prompt": ["a", "bb"], "max_tokens": 3, "n": 3, "seed": 10}
            return await post(c, "/v1/completions", body)

    body = run(go()).json()
    assert [ch["index"] for ch in body["choices"]] == list(range(6))
    assert len({rid for rid, _, _ in fake.calls}) == 6
    assert sorted(p.seed for _, _, p in fake.calls) == list(range(10, 16))
    assert body["usage"]["prompt_tokens"] == 3  # each prompt counted once, not per choice
    assert body["usage"]["completion_tokens"] == 18


def test_cache_salt_reaches_the_engine_and_an_empty_one_is_a_400(tokenizer):
    fake = FakeClient()

    async def go(body):
        async with make(tokenizer, [fake]) as c:
            return await post(c, "/v1/completions", {"prompt": "a", "max_tokens": 2, **body})

    assert run(go({"cache_salt": "tenant-a"})).status_code == 200
    assert fake.calls[-1][2].cache_salt == "tenant-a"
    assert run(go({})).status_code == 200 and fake.calls[-1][2].cache_salt == ""
    for salt in ("", "x" * 1025, 7):
        bad = run(go({"cache_salt": salt}))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    assert len(fake.calls) == 2


def test_stop_token_ids_reach_the_engine_and_bad_ones_are_a_400(tokenizer):
    fake = FakeClient()

    async def go(body):
        async with make(tokenizer, [fake]) as c:
            return await post(c, "/v1/completions", {"prompt": "a", "max_tokens": 2, **body})

    assert run(go({"stop_token_ids": [7, 9]})).status_code == 200
    assert fake.calls[-1][2].stop_token_ids == (7, 9)
    assert run(go({})).status_code == 200
    assert fake.calls[-1][2].stop_token_ids == ()
    bad = run(go({"stop_token_ids": [-1]}))
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("stop_token_ids")
    assert len(fake.calls) == 2


def test_the_stop_token_and_special_tokens_leave_the_text_unless_asked(tokenizer):
    """As vLLM: the token that ended the output (its EOS or a stop token) is not in the text,
    unless include_stop_str_in_output; special tokens are skipped unless skip_special_tokens
    is false; a stop string stays out of the text unless include_stop_str_in_output."""
    user = tokenizer.encode("<|user|>")
    assert len(user) == 1  # one special token
    ids = [*tokenizer.encode("ab"), *user, *tokenizer.encode("cd.")]

    def choice(body, stop_token=True, stream=False):
        fake = FakeClient(ids=ids, finish="stop", stop_token=stop_token)

        async def go():
            async with make(tokenizer, [fake]) as c:
                full = {"prompt": "a", "max_tokens": 9, "stream": stream, **body}
                return await post(c, "/v1/completions", full)

        if stream:
            return sse_events(run(go()).text)[-1]["choices"][0]
        return run(go()).json()["choices"][0]

    def text(body, stop_token=True):
        return choice(body, stop_token)["text"]

    assert text({}) == "abcd"
    assert text({}, stop_token=False) == "abcd."  # the guide ended it at its last token
    assert text({"include_stop_str_in_output": True}) == "abcd."
    assert text({"skip_special_tokens": False}) == "ab<|user|>cd"
    assert text({"stop": ["b"]}) == "a"
    assert text({"stop": ["b"], "include_stop_str_in_output": True}) == "ab"
    # vLLM's stop_reason: the stop string or stop token id; None for EOS
    (dot,) = tokenizer.encode(".")
    assert choice({})["stop_reason"] is None
    assert choice({"stop_token_ids": [dot]})["stop_reason"] == dot
    assert choice({"stop": ["zz", "c"]})["stop_reason"] == "c"
    assert choice({"stop": ["c"]}, stream=True)["stop_reason"] == "c"
    assert choice({"stop_token_ids": [dot]}, stream=True)["stop_reason"] == dot


def test_logprobs_shapes(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient()]) as c:
            chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
            a = await post(c, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2})
            b = await post(c, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 1})
            return a.json(), b.json()

    chat, comp = run(go())
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["h", "e"] and content[0]["bytes"] == [104]
    assert len(content[0]["top_logprobs"]) == 2
    lp = comp["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e"] and lp["text_offset"] == [0, 1]
    assert lp["token_logprobs"] == [-0.5, -0.5] and lp["top_logprobs"][0] == {"h": -0.5}


@pytest.mark.parametrize(
    "code, status", [("invalid_request", 400), ("overloaded", 429), ("unavailable", 503)]
)
def test_attention_errors_map_to_http_statuses(tokenizer, code, status):
    async def go():
        async with make(tokenizer, [FakeClient(error=code)]) as c:
            plain = await post(c, "/v1/completions", {"prompt": "x"})
            streamed = await post(c, "/v1/completions", {"prompt": "x", "stream": True})
            return plain, streamed

    plain, streamed = run(go())
    for r in (plain, streamed):  # a stream that fails before its first byte gets a status too
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    if status == 429:
        assert plain.headers["retry-after"]


def test_error_mid_stream_is_an_event_then_done(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient(error="unavailable", error_after=3)]) as c:
            return await post(c, "/v1/completions", {"prompt": "x", "stream": True})

    r = run(go())
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1]["error"]["code"] == "unavailable"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == TEXT[:3]


def test_while_starting_models_is_a_503_and_requests_wait_for_readiness(tokenizer):
    """A client polling /v1/models until it answers 200 and then sending a completion never
    meets a 503 for "not ready"; a request that arrives while the cluster is starting waits
    for it (up to --startup-wait) instead of failing at once."""

    class Starting(FakeClient):
        def __init__(self, ready_after):
            super().__init__(ready=False)
            self.polls, self.ready_after = 0, ready_after

        async def health(self):
            self.polls += 1
            self.ready = self.polls > self.ready_after
            return await super().health()

    async def go(fake, wait):
        async with make(tokenizer, [fake], startup_wait_s=wait) as c:
            models = await c.get("/v1/models")
            done = await post(c, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
            models_after = await c.get("/v1/models")
            return models, done, models_after

    models, done, models_after = run(go(Starting(ready_after=3), wait=10.0))
    assert models.status_code == 503 and models.json()["error"]["code"] == "starting"
    assert done.status_code == 200 and done.json()["choices"][0]["text"] == TEXT[:3]
    assert models_after.status_code == 200
    assert models_after.json()["data"][0]["max_model_len"] == 64
    never = Starting(ready_after=10**6)
    _, refused, _ = run(go(never, wait=0.3))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "starting"
    assert refused.headers["retry-after"] == "1" and not never.calls


def test_context_checks_happen_before_any_call(tokenizer):
    fake = FakeClient()

    async def go():
        async with make(tokenizer, [fake]) as c:
            long = await post(c, "/v1/completions", {"prompt": "x" * 64})
            over = await post(c, "/v1/completions", {"prompt": "x", "max_tokens": 64})
            ids = await post(c, "/v1/completions", {"prompt": [1, 5000]})
            model = await post(c, "/v1/completions", {"prompt": "x", "model": "other"})
            junk = await c.post(
                "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
            )
            return long, over, ids, model, junk

    long, over, ids, model, junk = run(go())
    assert long.status_code == over.status_code == ids.status_code == 400
    assert long.json()["error"]["code"] == over.json()["error"]["code"] == "context_length_exceeded"
    assert over.json()["error"]["param"] == "max_tokens"
    assert model.status_code == 400 and model.json()["error"]["code"] == "model_not_found"
    assert junk.status_code == 400 and junk.json()["error"]["code"] == "invalid_json"
    assert fake.calls == []


def test_api_key_deny_by_default_with_public_allowlist(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient()], api_key=KEY) as c:
            body = {"prompt": "x", "max_tokens": 1}
            return {
                "none": await post(c, "/v1/completions", body),
                "wrong": await post(
                    c, "/v1/completions", body, headers={"Authorization": "Bearer no"}
                ),
                "right": await post(
                    c, "/v1/completions", body, headers={"Authorization": f"Bearer {KEY}"}
                ),
                "x-api-key": await c.get("/v1/models", headers={"x-api-key": KEY}),
                "models": await c.get("/v1/models"),
                "unknown": await c.get("/admin"),
                "health": await c.get("/health"),
                "ready": await c.get("/ready"),
                "metrics": await c.get("/metrics"),
            }

    r = run(go())
    for name in ("none", "wrong", "models", "unknown"):
        assert r[name].status_code == 401, name
        assert r[name].json()["error"]["code"] == "invalid_api_key"
    for name in ("right", "x-api-key", "health", "ready", "metrics"):
        assert r[name].status_code == 200, name
    assert "afd_gateway_requests_total" in r["metrics"].text


def test_body_limit_with_and_without_content_length(tokenizer):
    big = json.dumps({"prompt": "x" * 5000}).encode()

    async def chunks():
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async def go():
        async with make(tokenizer, [FakeClient()], max_body_bytes=2000) as c:
            a = await c.post("/v1/completions", content=big)
            b = await c.post("/v1/completions", content=chunks())
            return a, b

    for r in run(go()):
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "body_too_large"


def test_models_ready_tokenize(tokenizer):
    async def go():
        async with make(tokenizer, [FakeClient(), FakeClient("fake:2", ready=False)]) as c:
            models = (await c.get("/v1/models")).json()
            ready = await c.get("/ready")
            tok = (await post(c, "/tokenize", {"prompt": "hé"})).json()
            text = (await post(c, "/detokenize", {"tokens": tok["tokens"]})).json()
            return models, ready, tok, text

    models, ready, tok, text = run(go())
    card = models["data"][0]
    assert card["id"] == "m" and card["max_model_len"] == 64 and card["description"] == "demo!"
    # Ready while one attention server is; the other is named with its reason.
    assert ready.status_code == 200 and "FFN down" in ready.json()["reasons"][0]
    assert [s["state"] for s in ready.json()["servers"]] == ["ready", "not ready"]
    assert tok["count"] == 3 and text["prompt"] == "hé"


def test_emoji_stream_never_sends_broken_text_and_goes_token_by_token(tokenizer):
    text = "a😀b"

    async def go():
        async with make(tokenizer, [FakeClient(text=text)]) as c:
            plain = await post(c, "/v1/completions", {"prompt": "x", "stream": True})
            body = {"prompt": "x", "stream": True, "logprobs": 0}
            with_lp = await post(c, "/v1/completions", body)
            return sse_events(plain.text), sse_events(with_lp.text)

    plain, with_lp = run(go())
    texts = [e["choices"][0]["text"] for e in plain]
    # a chunk per token, as vLLM streams: the emoji's four byte tokens each get one, its text
    # whole in the last, so a client can time every token without asking for logprobs
    assert texts == ["a", "", "", "", "😀", "b"]
    texts = [e["choices"][0]["text"] for e in with_lp]
    assert len(with_lp) == 6 and "".join(texts) == text and "\ufffd" not in "".join(texts)
    assert [len(e["choices"][0]["logprobs"]["tokens"]) for e in with_lp] == [1] * 6
