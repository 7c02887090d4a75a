"""OpenAI's Responses API through the gateway app against fake attention servers: bodies and
stream events validate as the official `openai` client's own types; the stream's events add up
to the whole response; reasoning, text and function calls land in their output items; input
items reach the chat template as the conversation they stand for."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from tests.unit.test_gateway_app import FakeClient as _Fake
from tests.unit.test_gateway_app import make, post, run
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture

types = pytest.importorskip("openai.types.responses")

THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CFG = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}


def FakeClient(**kw) -> _Fake:  # noqa: N802 - reads as the class it builds
    return _Fake(context=4096, finish="stop", **kw)


def _post(tokenizer, client, body, **cfg):
    async def go():
        async with make(tokenizer, [client], **cfg) as c:
            return await post(c, "/v1/responses", {"model": "m", **body})

    return run(go())


def _response(body: dict):
    """The body as openai's Response. afd does not count cache writes (the newest clients'
    usage field, not vLLM's): that one field is filled in; everything else is as sent."""
    if body.get("usage"):
        body["usage"]["input_tokens_details"].setdefault("cache_write_tokens", 0)
    return types.Response.model_validate(body)


def _events(text: str) -> list:
    """The stream's events, each checked against openai's ResponseStreamEvent."""
    adapter = TypeAdapter(types.ResponseStreamEvent)
    blocks = [b for b in text.split("\n\n") if b.strip()]
    out = []
    for b in blocks:
        name, data = b.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), b
        obj = json.loads(data[6:])
        if "response" in obj:
            obj["response"] = _response(obj["response"]).model_dump()
        ev = adapter.validate_python(obj)
        assert ev.type == name[7:]
        out.append(ev)
    assert [e.sequence_number for e in out] == list(range(len(out)))
    # the official client's stream helper replays them into its snapshot, checking the order
    # (a private class of the client: where a version lacks it, the events' types still are)
    try:
        from openai import omit
        from openai.lib.streaming.responses._responses import ResponseStreamState
    except ImportError:
        return out
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for ev in out:
        state.handle_event(ev)
    return out


def test_text_whole_and_streamed(tokenizer):
    r = _post(tokenizer, FakeClient(text="Sunny."), {"input": "weather?"})
    assert r.status_code == 200, r.text
    resp = _response(r.json())
    assert resp.status == "completed" and resp.output_text == "Sunny."
    assert resp.temperature == 1.0 and resp.top_p == 1.0  # what ran
    assert resp.usage.output_tokens == 6 and resp.usage.total_tokens > 6

    s = _post(tokenizer, FakeClient(text="Sunny."), {"input": "weather?", "stream": True})
    events = _events(s.text)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Sunny." and events[-1].response.output_text == "Sunny."


def test_output_text_logprobs_whole_and_streamed(tokenizer):
    body = {"input": "weather?", "top_logprobs": 2}
    whole = _response(_post(tokenizer, FakeClient(text="Sunny."), body).json())
    (part,) = whole.output[0].content
    assert [e.token for e in part.logprobs] == list("Sunny.")
    assert all(e.logprob == -0.5 and len(e.top_logprobs) == 2 for e in part.logprobs)
    s = _post(tokenizer, FakeClient(text="Sunny."), {**body, "stream": True})
    events = _events(s.text)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    want = [lp.model_dump() for lp in part.logprobs]
    assert [lp.model_dump() for e in deltas for lp in e.logprobs] == want
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.model_dump() for lp in done.logprobs] == want
    # a last token without text (the stop token) has its logprob in a stream's done event
    # and final response too, as in the whole one
    stop = {"ids": list(b"Sunny.") + [2], "stop_token": True}
    whole = _response(_post(tokenizer, FakeClient(**stop), body).json())
    want = [lp.model_dump() for lp in whole.output[0].content[0].logprobs]
    assert len(want) == 7 and whole.output_text == "Sunny."
    events = _events(_post(tokenizer, FakeClient(**stop), {**body, "stream": True}).text)
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0]
    assert [lp.model_dump() for lp in done.logprobs] == want
    assert [lp.model_dump() for lp in final.logprobs] == want
    # asked by include alone: no alternatives; not asked: none
    inc = {"input": "weather?", "include": ["message.output_text.logprobs"]}
    (part,) = _response(_post(tokenizer, FakeClient(text="Hi"), inc).json()).output[0].content
    assert len(part.logprobs) == 2 and part.logprobs[0].top_logprobs == []
    plain = _response(_post(tokenizer, FakeClient(text="Hi"), {"input": "x"}).json())
    assert plain.output[0].content[0].logprobs == []


def test_reasoning_and_calls_get_their_items_whole_and_streamed(tokenizer):
    body = {"input": "weather?", "tools": [WEATHER]}
    r = _post(tokenizer, FakeClient(text=THOUGHT + "Let me look. " + CALL), body, **CFG)
    resp = _response(r.json())
    kinds = [o.type for o in resp.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert resp.output[0].content[0].text == "The user wants the weather."
    assert resp.output_text == "Let me look."
    call = resp.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.call_id.startswith("call_")

    s = _post(
        tokenizer,
        FakeClient(text=THOUGHT + "Let me look. " + CALL),
        {**body, "stream": True},
        **CFG,
    )
    events = _events(s.text)
    final = events[-1].response
    assert [o.type for o in final.output] == kinds
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [d.model_dump(exclude={"id", "call_id"}) for d in done] == [
        o.model_dump(exclude={"id", "call_id"}) for o in resp.output
    ]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "The user wants the weather."


def test_input_items_become_the_conversation(tokenizer):
    fake = FakeClient(text="It is 3 degrees.")
    body = {
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather in Oslo?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 3}'},
        ],
        "tools": [WEATHER],
        "tool_choice": "none",
    }  # fmt: skip
    r = _post(tokenizer, fake, body, **CFG)
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(fake.calls[0][1], skip_special_tokens=False)
    for shown in ("be brief", "weather in Oslo?", '"get_weather"', '{"temp": 3}'):
        assert shown in prompt, (shown, prompt)
    assert prompt.index("weather in Oslo?") < prompt.index('{"temp": 3}')


def test_guides_limits_and_refusals(tokenizer):
    fake = FakeClient(text='{"a": 1}')
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    r = _post(tokenizer, fake, {"input": "json please", "text": fmt})
    assert fake.calls[0][2].guide_kind == "json"
    assert _response(r.json()).output_text == '{"a": 1}'
    long = _Fake(context=4096, text="abc", finish="length")  # cut at max_tokens
    cut = _post(tokenizer, long, {"input": "x", "max_output_tokens": 3})
    resp = _response(cut.json())
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    for bad, why in [
        ({"input": "x", "previous_response_id": "resp_1"}, "no response 'resp_1' is stored"),
        ({"input": "x", "conversation": "conv_1"}, "conversation objects are not served"),
        ({"input": "x", "background": True, "store": False}, "needs store: true"),
        ({"input": []}, "input"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice needs tools"),
        ({"input": "x", "model": "other"}, "does not exist"),
        ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ]:
        r = _post(tokenizer, FakeClient(), bad)
        assert r.status_code in (400, 404) and why in r.json()["error"]["message"], r.text


def test_instructions_go_where_the_models_template_reads_them():
    from services.gateway.responses_schema import ResponsesRequest

    req = ResponsesRequest(input="x", instructions="be brief")
    assert [m.role for m in req.to_chat().messages] == ["system", "user"]
    assert req.to_chat("developer").messages[0].role == "developer"  # gpt-oss's harmony
    assert ResponsesRequest(input="x", priority=-2).to_chat().priority == -2  # vLLM's extra
