"""The Responses API's truncation "auto": a conversation past the context loses its oldest
items (never leaving a call's output without its call); "disabled" refuses it whole."""

from __future__ import annotations

from tests.unit.test_gateway_app import FakeClient as _Fake
from tests.unit.test_gateway_app import make, post, run
from tests.unit.test_gateway_app import tokenizer as tokenizer  # noqa: F401 - the fixture

CONTEXT = 400  # tokens: bytes, with this tokenizer


def _turns(k: int) -> list[dict]:
    return [{"role": "user", "content": f"turn {i}: " + "x" * 60} for i in range(k)]


def test_the_oldest_items_go_until_the_prompt_fits(tokenizer):
    fake = _Fake(context=CONTEXT, text="ok", finish="stop")
    body = {"input": _turns(8), "max_output_tokens": 20, "instructions": "be brief"}

    async def go():
        async with make(tokenizer, [fake]) as c:
            whole = await post(c, "/v1/responses", body)
            cut = await post(c, "/v1/responses", {**body, "truncation": "auto"})
            short = await post(c, "/v1/responses", {**body, "input": _turns(2),
                                                    "truncation": "auto"})  # fmt: skip
            return whole, cut, short

    whole, cut, short = run(go())
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "context_length_exceeded"
    assert cut.status_code == 200 and cut.json()["truncation"] == "auto"
    prompt = tokenizer.decode(fake.calls[0][1], skip_special_tokens=False)
    assert len(fake.calls[0][1]) + 20 <= CONTEXT
    assert "be brief" in prompt and "turn 7:" in prompt and "turn 0:" not in prompt
    kept = [i for i in range(8) if f"turn {i}:" in prompt]
    assert kept == list(range(kept[0], 8))  # a tail, as long as fits: one more turn (its
    assert len(fake.calls[0][1]) + 20 + len(_turns(1)[0]["content"]) > CONTEXT  # text) not
    assert short.status_code == 200  # fits: untouched
    assert "turn 0:" in tokenizer.decode(fake.calls[1][1], skip_special_tokens=False)


def test_a_calls_output_never_starts_what_is_kept(tokenizer):
    """Kept from the call on it would not fit, from its output on it would: the output goes
    with its call."""
    fake = _Fake(context=CONTEXT, text="ok", finish="stop")
    args = '{"a": "' + "z" * 250 + '"}'
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": args}
    output = {"type": "function_call_output", "call_id": "c1", "output": "y" * 100}
    body = {"input": [*_turns(1), call, output, {"role": "user", "content": "and now?"}],
            "truncation": "auto", "max_output_tokens": 20}  # fmt: skip

    async def go():
        async with make(tokenizer, [fake]) as c:
            return await post(c, "/v1/responses", body)

    r = run(go())
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(fake.calls[0][1], skip_special_tokens=False)
    assert "and now?" in prompt and "z" * 250 not in prompt and "y" * 100 not in prompt
