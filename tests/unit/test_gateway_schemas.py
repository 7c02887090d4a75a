"""The OpenAI request models: the four prompt shapes, strict types, ranges, extras ignored."""

import pytest
from pydantic import ValidationError

from services.gateway.errors import validation_message
from services.gateway.schemas import (
    MAX_N,
    MAX_STOP,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_four_prompt_shapes(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [1, "a"]},
        {"prompt": [-1]},
        {"prompt": [1.5]},
        {"prompt": "x", "max_tokens": "5"},
        {"prompt": "x", "max_tokens": -3},
        {"prompt": "x", "stream": "yes"},
        {"prompt": "x", "n": 0},
        {"prompt": "x", "n": MAX_N + 1},
        {"prompt": "x", "temperature": -0.1},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "top_k": -2},
        {"prompt": "x", "seed": 2**64},
        {"prompt": "x", "stop": [""]},
        {"prompt": "x", "stop": ["s"] * (MAX_STOP + 1)},
        {"prompt": "x", "logprobs": 1 << 21},
        {"prompt": "x", "prompt_logprobs": 1, "stream": True},
        {"prompt": "x", "prompt_logprobs": -1},
        {"prompt": "x", "suffix": "tail"},
        {"prompt": "x", "presence_penalty": 3},
        {"prompt": ["x"] * 65},
    ],
)
def test_bad_completion_requests_are_rejected(bad):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(bad)


def test_defaults_and_extras():
    r = CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "logit_bias": {}, "t": 1})
    assert r.max_new_tokens == 16 and r.n == 1 and r.temperature == 1.0
    assert r.stop_strings == () and r.num_logprobs is None and not r.include_usage
    r = CompletionRequest(prompt="x", stop="END", temperature=0, stream=True)
    assert r.stop_strings == ("END",) and r.temperature == 0.0
    r = CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True})
    assert r.include_usage


def test_chat_fields():
    r = ChatCompletionRequest(messages=USER, max_tokens=5, max_completion_tokens=7)
    assert r.max_new_tokens == 7  # the newer name wins
    assert ChatCompletionRequest(messages=USER).max_new_tokens is None  # the rest of the context
    assert ChatCompletionRequest(messages=USER, logprobs=True).num_logprobs == 0
    assert ChatCompletionRequest(messages=USER, logprobs=True, top_logprobs=3).num_logprobs == 3
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=USER, top_logprobs=3)
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "wizard", "content": "x"}])


def test_chat_content_parts():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    m = ChatCompletionRequest(messages=[{"role": "user", "content": parts}]).messages[0]
    assert m.template_dict() == {"role": "user", "content": [dict(p) for p in parts]}
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": image}])


def test_tokenize_needs_exactly_one_input():
    assert TokenizeRequest(prompt="x").prompt == "x"
    with pytest.raises(ValidationError):
        TokenizeRequest()
    with pytest.raises(ValidationError):
        TokenizeRequest(prompt="x", messages=USER)


def test_validation_message_names_the_parameter():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "many"})
    msg, param = validation_message(e.value.errors())
    assert param == "max_tokens" and msg.startswith("max_tokens:")


def test_a_bad_prompt_gets_one_clear_message():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": [[1], "x"]})
    msg, param = validation_message(e.value.errors())
    assert param == "prompt" and "list of token ids" in msg
