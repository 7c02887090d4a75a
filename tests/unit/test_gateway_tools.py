"""Tools through the gateway app against fake attention servers: the definitions reach the
chat template, each tool_choice gives the attention server the guide it needs, calls come back
as OpenAI's `tool_calls` (whole and streamed, the stream adding up to the whole body), and
requests the server cannot honour are 400s that name their cause."""

from __future__ import annotations

import json

import pytest

from afd import demo
from afd.tokenizer import ModelTokenizer
from tests.unit.test_gateway_app import FakeClient as _Fake
from tests.unit.test_gateway_app import make, post, run, sse_events
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture
from tests.unit.test_tool_calls import BEGIN, CALL_END, END, SEP, V3_W
from tests.unit.test_tool_calls import CALL as CALL_TAG

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "now & <soon>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}
MSGS = [{"role": "user", "content": "weather?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
CALLED = f"Checking.\n<tool_call>{CALL}</tool_call>"
AUTO = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}


def FakeClient(**kw) -> _Fake:  # noqa: N802 - reads as the class it builds
    return _Fake(context=4096, **kw)  # room for tool definitions in the prompt


def _chat(tokenizer, client, body, stream=False, **cfg):
    async def go():
        async with make(tokenizer, [client], **cfg) as c:
            r = await post(c, "/v1/chat/completions", {"messages": MSGS, **body, "stream": stream})
            return r

    return run(go())


def _streamed(events) -> tuple[str, list[dict], str]:
    """A stream's content, merged tool calls and finish reason, as a client adds them up."""
    content, calls, finish = "", {}, None
    for e in events:
        for ch in e["choices"]:
            content += ch["delta"].get("content") or ""
            for d in ch["delta"].get("tool_calls", []):
                c = calls.setdefault(d["index"], {"function": {"arguments": ""}})
                c.update({k: d[k] for k in ("id", "type") if k in d})
                if "name" in d["function"]:
                    c["function"]["name"] = d["function"]["name"]
                c["function"]["arguments"] += d["function"].get("arguments", "")
            finish = ch["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_reads_hermes_calls_whole_and_streamed(tokenizer):
    body = {"tools": [WEATHER, NOOP], "max_tokens": 200}
    whole = _chat(tokenizer, FakeClient(text=CALLED, finish="stop"), body, **AUTO).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Checking."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}

    r = _chat(tokenizer, FakeClient(text=CALLED, finish="stop"), body, stream=True, **AUTO)
    content, calls, finish = _streamed(sse_events(r.text))
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [c["function"] for c in calls] == [call["function"]]


def test_without_a_call_the_answer_is_plain(tokenizer):
    r = _chat(
        tokenizer, FakeClient(text="no call <tool", finish="stop"), {"tools": [WEATHER]}, **AUTO
    )
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no call <tool"}
    assert choice["finish_reason"] == "stop"


def test_tools_reach_the_chat_template(tokenizer):
    client = FakeClient(finish="stop")
    history = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C"},
    ]
    r = _chat(tokenizer, client, {"tools": [WEATHER], "messages": history, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(client.calls[0][1], skip_special_tokens=False)
    assert json.dumps(WEATHER) in prompt  # unescaped: "now & <soon>"
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert "<|tool|>3 C<|end|>" in prompt
    assert client.calls[0][2].guide_kind == ""  # "none": nothing guided, nothing parsed
    assert r.json()["choices"][0]["message"]["content"] == "hello world, all good"


def test_named_and_required_guide_the_output_into_calls(tokenizer):
    args = '{"city": "Oslo"}'
    client = FakeClient(text=args, finish="stop")
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"tools": [WEATHER, NOOP], "tool_choice": named}
    whole = _chat(tokenizer, client, body).json()["choices"][0]  # no parser needed
    params = client.calls[0][2]
    assert params.guide_kind == "json"
    assert json.loads(params.guide) == WEATHER["function"]["parameters"]
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] is None
    assert whole["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": args,
    }
    r = _chat(tokenizer, FakeClient(text=args, finish="stop"), body, stream=True)
    content, calls, _ = _streamed(sse_events(r.text))
    assert content == "" and [c["function"] for c in calls] == [
        whole["message"]["tool_calls"][0]["function"]
    ]

    arr = f'[{{"name": "noop", "arguments": {{}}}}, {CALL}]'
    client = FakeClient(text=arr, finish="stop")
    body = {"tools": [WEATHER, NOOP], "tool_choice": "required", "parallel_tool_calls": False}
    whole = _chat(tokenizer, client, {**body, "max_tokens": 200}).json()["choices"][0]
    schema = json.loads(client.calls[0][2].guide)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert whole["finish_reason"] == "tool_calls"
    names = [c["function"]["name"] for c in whole["message"]["tool_calls"]]
    assert names == ["noop", "get_weather"]  # the guide, not the reader, limits the count


@pytest.mark.parametrize(
    "body,cfg,match",
    [
        ({"tools": [WEATHER]}, {}, "requires --enable-auto-tool-choice"),
        ({"tool_choice": "required"}, AUTO, "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, AUTO,
         "not in tools"),
        ({"tools": [WEATHER, WEATHER]}, AUTO, "same name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, AUTO, "name"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, AUTO, "only one of"),
        ({"chat_template_kwargs": {"tools": []}}, {}, "cannot be replaced"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, {},
         "not a JSON object"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, {},
         "only an assistant"),
    ],
)  # fmt: skip
def test_requests_the_server_cannot_honour_are_400s(tokenizer, body, cfg, match):
    client = FakeClient()
    r = _chat(tokenizer, client, body, **cfg)
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]
    assert client.calls == []  # nothing ran


def test_a_parser_that_does_not_exist_is_a_config_error():
    from afd.errors import ConfigError
    from services.gateway.app import GatewayConfig

    with pytest.raises(ConfigError, match="no tool-call parser 'nope'"):
        GatewayConfig("m", ("a:1",), "m", tool_call_parser="nope")
    with pytest.raises(ConfigError, match="needs a --tool-call-parser"):
        GatewayConfig("m", ("a:1",), "m", enable_auto_tool_choice=True)


@pytest.fixture(scope="module")
def deepseek_tokenizer(tmp_path_factory):
    """The demo byte tokenizer plus DeepSeek's tool-call tags as special tokens."""
    d = tmp_path_factory.mktemp("deepseek")
    demo.write_tokenizer(d)
    tok = demo.build_tokenizer()
    tok.add_special_tokens([BEGIN, END, CALL_TAG, CALL_END, SEP])
    tok.save(str(d / "tokenizer.json"))
    return ModelTokenizer(d)


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_calls_written_in_special_tokens_are_read(deepseek_tokenizer, stream):
    """The tags are special tokens: the choice's text keeps them for the parser, and the
    content keeps none of them."""
    tok = deepseek_tokenizer
    ids = tok.encode(f"Let me look.{BEGIN}{V3_W}{END}")
    assert len(ids) < len(f"Let me look.{BEGIN}{V3_W}{END}".encode())  # tags are single tokens
    cfg = {"tool_call_parser": "deepseek_v3", "enable_auto_tool_choice": True}
    r = _chat(tok, FakeClient(ids=ids, finish="stop"), {"tools": [WEATHER]}, stream, **cfg)
    if stream:
        content, calls, finish = _streamed(sse_events(r.text))
    else:
        choice = r.json()["choices"][0]
        content, calls = choice["message"]["content"], choice["message"]["tool_calls"]
        finish = choice["finish_reason"]
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Zürich", "days": 2}
    # without tools the same text is the answer, its special tokens skipped as ever
    plain = _chat(tok, FakeClient(ids=ids, finish="stop"), {}, **cfg).json()["choices"][0]
    assert "｜" not in plain["message"]["content"]
