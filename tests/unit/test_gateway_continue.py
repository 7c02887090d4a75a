"""vLLM's continue_final_message and chat echo through the gateway app: the prompt ends inside
the assistant's last message (as the renderer cuts it, tests/unit/test_chat_template.py), and
echo starts the answer with that message's text, whole and streamed."""

from __future__ import annotations

from tests.unit.test_gateway_app import FakeClient, make, post, run, sse_events
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture

MSGS = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "It is"}]
OPEN = {"continue_final_message": True, "add_generation_prompt": False}


def _chat(tokenizer, body, fake=None):
    fake = fake or FakeClient(text=" 4.", finish="stop")

    async def go():
        async with make(tokenizer, [fake]) as c:
            full = {"messages": MSGS, "max_tokens": 8, **body}
            return await post(c, "/v1/chat/completions", full)

    return run(go())


def test_the_prompt_ends_inside_the_last_message(tokenizer):
    fake = FakeClient(text=" 4.", finish="stop")
    r = _chat(tokenizer, OPEN, fake)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " 4."
    prompt = tokenizer.decode(fake.calls[0][1], skip_special_tokens=False)
    assert prompt.endswith("<|assistant|>It is"), prompt
    closed = tokenizer.decode(_sent(tokenizer, {"add_generation_prompt": False}), False)
    assert closed.startswith(prompt) and len(closed) > len(prompt)  # its end of turn went


def test_echo_starts_the_answer_with_the_assistants_last_text(tokenizer):
    msg = _chat(tokenizer, {**OPEN, "echo": True}).json()["choices"][0]["message"]
    assert msg["content"] == "It is 4."
    events = sse_events(_chat(tokenizer, {**OPEN, "echo": True, "stream": True}).text)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == "It is 4."
    user_last = [MSGS[0]]
    fake = FakeClient(text=" 4.", finish="stop")

    async def go():
        async with make(tokenizer, [fake]) as c:
            body = {"messages": user_last, "max_tokens": 8, "echo": True}
            return await post(c, "/v1/chat/completions", body)

    assert run(go()).json()["choices"][0]["message"]["content"] == " 4."  # not the user's


def test_continuing_and_a_generation_prompt_together_are_a_400(tokenizer):
    r = _chat(tokenizer, {"continue_final_message": True})
    assert r.status_code == 400
    assert "add_generation_prompt" in r.json()["error"]["message"]

    async def go():
        async with make(tokenizer, [FakeClient()]) as c:
            return await post(c, "/tokenize", {"messages": MSGS, **OPEN})

    ids = run(go()).json()["tokens"]
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|assistant|>It is")


def _sent(tokenizer, body) -> list[int]:
    fake = FakeClient(text=" 4.", finish="stop")
    assert _chat(tokenizer, body, fake).status_code == 200
    return fake.calls[0][1]


def test_tokenize_refuses_a_chat_the_chat_route_would_refuse(tokenizer):
    """Found by the HTTP fuzz: two tools of one name passed /tokenize's own schema and the
    chat built from it raised (a 500); the chat's rules are the client's 400 there too."""
    tool = {"type": "function", "function": {"name": "f"}}

    async def go():
        async with make(tokenizer, [FakeClient()]) as c:
            return await post(c, "/tokenize", {"messages": MSGS, "tools": [tool, tool]})

    r = run(go())
    assert r.status_code == 400 and "same name" in r.json()["error"]["message"]
