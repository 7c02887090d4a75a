"""Reasoning parsers (services/gateway/reasoning.py) and reasoning through the gateway app: the
same split of reasoning and content whether the text comes whole, in two pieces split
anywhere, or a character at a time; with tools, calls are read from the content only; a guided
answer's guide waits for the reasoning to end (and is split there) unless the prompt closed it."""

from __future__ import annotations

import pytest

from services.gateway.reasoning import DeepSeekR1Parser, Qwen3Parser, Step3Parser, think_marker
from tests.unit.test_gateway_app import FakeClient, make, post, run, sse_events
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture
from tests.unit.test_gateway_tools import WEATHER, _streamed
from tests.unit.test_tool_calls import splits

CASES = [
    # (parser, text, reasoning, content)
    (Qwen3Parser, "<think>\nHmm, 2+2.\n</think>\n\nIt is 4.", "Hmm, 2+2.", "It is 4."),
    (Qwen3Parser, "<think>\n\n</think>\n\nIt is 4.", "", "It is 4."),
    (Qwen3Parser, "It is 4. <think>no</think>", "", "It is 4. <think>no</think>"),
    (Qwen3Parser, "<thin", "", "<thin"),
    (Qwen3Parser, "<think>cut off by max_tokens </thi", "cut off by max_tokens </thi", ""),
    (DeepSeekR1Parser, "Hmm, 2+2.\n</think>\n\nIt is 4.", "Hmm, 2+2.", "It is 4."),
    (DeepSeekR1Parser, "<think>Hmm.</think>It is 4.", "Hmm.", "It is 4."),
    (DeepSeekR1Parser, "never closed", "never closed", ""),
    (DeepSeekR1Parser, "a <b> c \n </think>", "a <b> c", ""),
    (Step3Parser, "Hmm, 2+2.</think>It is 4.", "Hmm, 2+2.", "It is 4."),
    (Step3Parser, "never closed", "never closed", ""),
]


@pytest.mark.parametrize("cls,text,reasoning,content", CASES)
def test_the_split_is_the_same_however_the_text_comes(cls, text, reasoning, content):
    for pieces in splits(text):
        p = cls()
        r, c = zip(*[p.feed(x) for x in pieces], strict=True)
        last_r, last_c = p.finish()
        assert ("".join(r) + last_r, "".join(c) + last_c) == (reasoning, content), pieces


THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
MSGS = [{"role": "user", "content": "weather?"}]
CFG = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}


def _chat(tokenizer, text, body, stream=False, client=None):
    client = client or FakeClient(text=text, finish="stop", context=4096)

    async def go():
        async with make(tokenizer, [client], **CFG) as c:
            full = {"messages": MSGS, "max_tokens": 300, "stream": stream, **body}
            return await post(c, "/v1/chat/completions", full)

    return run(go())


def test_reasoning_content_whole_and_streamed_with_and_without_calls(tokenizer):
    msg = _chat(tokenizer, THOUGHT + "Sunny.", {}).json()["choices"][0]["message"]
    assert msg == {
        "role": "assistant",
        "content": "Sunny.",
        "reasoning_content": "The user wants the weather.",
    }
    events = sse_events(_chat(tokenizer, THOUGHT + "Sunny.", {}, stream=True).text)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == "Sunny."

    r = _chat(tokenizer, THOUGHT + CALL, {"tools": [WEATHER]}).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None
    assert r["message"]["reasoning_content"] == "The user wants the weather."
    assert r["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    events = sse_events(_chat(tokenizer, THOUGHT + CALL, {"tools": [WEATHER]}, stream=True).text)
    content, calls, finish = _streamed(events)
    assert (content, finish, len(calls)) == ("", "tool_calls", 1)


def test_a_call_inside_the_reasoning_is_not_a_call(tokenizer):
    text = f"<think>maybe {CALL}?</think>No call."
    r = _chat(tokenizer, text, {"tools": [WEATHER]}).json()["choices"][0]
    assert r["message"] == {
        "role": "assistant",
        "content": "No call.",
        "reasoning_content": f"maybe {CALL}?",
    }


def test_a_guided_answer_is_guided_after_the_reasoning(tokenizer):
    """The attention server is asked to start the guide after </think> (vLLM's order: think,
    then the structured answer), and the answer is split there, whole, streamed, or as the
    calls of tool_choice "required"."""
    end = tuple(tokenizer.encode("</think>"))
    client = FakeClient(text=THOUGHT + '{"a": 1}', finish="stop", context=4096)
    r = _chat(tokenizer, "", {"response_format": {"type": "json_object"}}, client=client)
    assert client.calls[0][2].guide_kind == "json_object"
    assert client.calls[0][2].guide_after == end
    assert r.json()["choices"][0]["message"] == {
        "role": "assistant",
        "content": '{"a": 1}',
        "reasoning_content": "The user wants the weather.",
    }
    events = sse_events(_chat(tokenizer, THOUGHT + "x", {"guided_regex": ".*"}, True).text)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants the weather."
    assert "".join(d.get("content", "") for d in deltas) == "x"

    calls = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    body = {"tools": [WEATHER], "tool_choice": "required"}
    r = _chat(tokenizer, THOUGHT + calls, body).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls"
    assert r["message"]["reasoning_content"] == "The user wants the weather."
    assert r["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_a_prompt_that_closed_the_thinking_is_guided_from_the_first_token(tokenizer):
    """Qwen3's template with enable_thinking false ends the prompt with an empty think block:
    there is no reasoning to wait for."""
    closed = tokenizer.encode("<|user|>hi<|assistant|><think>\n\n</think>\n\n")
    assert think_marker("qwen3", tokenizer, closed) == ()
    opened = tokenizer.encode("<|user|>hi<|assistant|><think>\n")
    assert think_marker("deepseek_r1", tokenizer, opened) == tuple(tokenizer.encode("</think>"))
