"""gpt-oss's harmony answers (services/gateway/harmony.py): channels read into reasoning,
content and tool calls, the same however the text is split; through the gateway app with a
tokenizer whose harmony tokens are special (so the reader only works if the gateway keeps
them in the text); the parser flags checked against the model's chat format."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from afd import demo
from afd.errors import ConfigError
from afd.tokenizer import ModelTokenizer
from services.gateway.app import GatewayConfig, check_parsers, create_app
from services.gateway.balancer import Balancer
from services.gateway.detok import TokenBytes
from services.gateway.handlers import GatewayState
from services.gateway.harmony import HarmonyReader
from tests.unit.test_gateway_app import FakeClient, sse_events
from tests.unit.test_gateway_tools import WEATHER, _streamed
from tests.unit.test_tool_calls import splits

A = "<|channel|>analysis<|message|>User asks: 2 + 2? Simple.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"Tokyo"}<|call|>'
)
CALL_IN_ROLE = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"location": "Oslo"}<|call|>'
)
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking two cities.<|end|>"
BROWSE = '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|call|>'
CASES = [
    # (text, read_calls, reasoning, content, [(name, arguments)])
    (A + FINAL, True, "User asks: 2 + 2? Simple.", "2 + 2 = 4.", []),
    (A + CALL, True, "User asks: 2 + 2? Simple.", "", [("get_weather", '{"location":"Tokyo"}')]),
    (A + CALL_IN_ROLE, True, "User asks: 2 + 2? Simple.", "",
     [("get_weather", '{"location": "Oslo"}')]),
    (PREAMBLE[len("<|start|>assistant"):] + CALL, True, "", "Checking two cities.",
     [("get_weather", '{"location":"Tokyo"}')]),
    (A + CALL, False, 'User asks: 2 + 2? Simple.{"location":"Tokyo"}', "", []),
    (A + BROWSE, True, 'User asks: 2 + 2? Simple.{"query": "x"}', "", []),
    ("a model that does not speak harmony", True, "", "a model that does not speak harmony", []),
    (A + "<|start|>assistant<|channel|>final<|message|>The answ", True,
     "User asks: 2 + 2? Simple.", "The answ", []),
]  # fmt: skip


@pytest.mark.parametrize("text,read_calls,reasoning,content,calls", CASES)
def test_harmony_reads_the_same_however_the_text_is_split(
    text, read_calls, reasoning, content, calls
):
    for pieces in splits(text, 3):
        r = HarmonyReader(read_calls)
        got = [r.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(g.reasoning for g in got) == reasoning, pieces
        assert "".join(g.content for g in got) == content, pieces
        made = [c for g in got for c in g.calls]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in made] == calls
        assert [c["index"] for c in made] == list(range(len(calls)))
        assert r.finish_reason("stop") == ("tool_calls" if calls else "stop")


HARMONY_TOKENS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory):
    """The demo byte tokenizer plus harmony's tokens as special tokens (<|end|> it has)."""
    d = tmp_path_factory.mktemp("harmony")
    demo.write_tokenizer(d)
    tok = demo.build_tokenizer()
    tok.add_special_tokens(HARMONY_TOKENS)
    tok.save(str(d / "tokenizer.json"))
    return ModelTokenizer(d)


def _chat(tok, text, body, stream=False, sent=None, **cfg):
    """The app's answer to a chat whose model says `text`; `sent` gets the parameters the
    attention server was asked for."""
    ids = tok.encode(text)

    async def go():
        client = FakeClient(ids=ids, finish="stop", context=4096)
        client.calls = sent if sent is not None else client.calls
        state = GatewayState(tok, TokenBytes(tok), Balancer([client]), "m", 512, "",
                             chat_format="harmony")  # fmt: skip
        app = create_app(state, GatewayConfig("unused", ("fake:1",), "m", **cfg))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            msgs = [{"role": "user", "content": "q"}]
            full = {"messages": msgs, "max_tokens": 300, "stream": stream, **body}
            return await c.post("/v1/chat/completions", json=full)

    return asyncio.run(go())


def test_a_harmony_model_answers_with_reasoning_content_and_tool_calls(harmony_tokenizer):
    tok = harmony_tokenizer
    assert len(tok.encode(A + FINAL)) == len(A + FINAL) - 63  # 7 special tokens, not bytes
    r = _chat(tok, A + FINAL, {}).json()["choices"][0]
    assert r["message"] == {
        "role": "assistant",
        "content": "2 + 2 = 4.",
        "reasoning_content": "User asks: 2 + 2? Simple.",
    }
    assert r["finish_reason"] == "stop"
    auto = {"tool_call_parser": "openai", "enable_auto_tool_choice": True}
    r = _chat(tok, A + CALL, {"tools": [WEATHER]}, **auto).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None
    (call,) = r["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"location":"Tokyo"}'}
    events = sse_events(_chat(tok, A + CALL, {"tools": [WEATHER]}, stream=True, **auto).text)
    content, calls, finish = _streamed(events)
    assert (content, finish) == ("", "tool_calls")
    assert [c["function"] for c in calls] == [call["function"]]
    reasoning = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events)
    assert reasoning == "User asks: 2 + 2? Simple."

    # structured outputs hold in the final body (the analysis before it is free), as vLLM
    # guides gpt-oss; a tool_choice guide leaves the model no harmony: its text is the calls
    ans = '<|start|>assistant<|channel|>final<|message|>{"a": 1}<|return|>'
    body = {"guided_json": {"type": "object"}}
    guided = _chat(tok, A + ans, body).json()["choices"][0]["message"]
    assert guided == {
        "role": "assistant",
        "content": '{"a": 1}',
        "reasoning_content": "User asks: 2 + 2? Simple.",
    }
    sent = []
    _chat(tok, A + ans, body, sent=sent)
    assert sent[0][2].guide_after == tuple(tok.encode("<|channel|>final<|message|>"))
    named = {"type": "function", "function": {"name": "get_weather"}}
    args = '{"location": "Oslo"}'
    body = {"tools": [WEATHER], "tool_choice": named}
    r = _chat(tok, args, body, sent=sent).json()["choices"][0]["message"]
    assert r["tool_calls"][0]["function"]["arguments"] == args and not sent[-1][2].guide_after


def test_the_parsers_must_fit_the_models_chat_format():
    cfg = GatewayConfig("m", ("a:1",), "m", tool_call_parser="hermes")
    check_parsers(cfg, "text")
    with pytest.raises(ConfigError, match="harmony needs openai"):
        check_parsers(cfg, "harmony")
    with pytest.raises(ConfigError, match="it is for gpt-oss"):
        check_parsers(GatewayConfig("m", ("a:1",), "m", reasoning_parser="openai_gptoss"), "text")
    check_parsers(GatewayConfig("m", ("a:1",), "m", reasoning_parser="openai_gptoss"), "harmony")
    with pytest.raises(ConfigError, match="harmony needs openai_gptoss"):
        check_parsers(GatewayConfig("m", ("a:1",), "m", reasoning_parser="qwen3"), "harmony")


def test_gpt_oss_checkpoints_say_they_speak_harmony(tmp_path):
    from afd.config import ModelConfig
    from tests.helpers.checkpoints import REFERENCE_CHECKPOINTS

    for name, chat_format in (("gpt_oss", "harmony"), ("qwen3_moe", "text")):
        path = REFERENCE_CHECKPOINTS[name](tmp_path / name)
        assert ModelConfig.from_hf(path).chat_format == chat_format
