"""afd's chat-template renderer (afd/tokenizer.py) against `transformers`' apply_chat_template,
the renderer the templates are written for: the same text for tools, tool calls, tool
results, extra variables and the helpers templates use (tojson's options and its unescaped
HTML characters, raise_exception, strftime_now, break/continue, namespace)."""

from __future__ import annotations

import pytest

from afd import demo
from afd.errors import RequestError
from afd.tokenizer import ModelTokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & 'later' in a city; ünïcode ok",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Zürich & Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
        ],
    },
    {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"},
    {"role": "tool", "content": "<b>sunny</b>", "tool_call_id": "call_2"},
]

# Exercises what templates in the wild lean on beyond plain loops.
HELPERS_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}{%- continue -%}{%- endif -%}"
    "{%- set ns.n = ns.n + 1 -%}"
    "[{{ m['role'] }}]{{ m['content'] }}"
    "{%- if ns.n >= 3 -%}{%- break -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}{{ tools | tojson(indent=2, sort_keys=True) }}"
    "{{ tools[0] | tojson(separators=(',', ':')) }}{{ tools[0] | tojson(ensure_ascii=True) }}"
    "{%- endif -%}"
    "|{{ strftime_now('%Y') }}|{{ enable_thinking }}|{{ bos_token }}"
    "{%- if documents is not none -%}{{ raise_exception('documents given') }}{%- endif -%}"
    "{%- if add_generation_prompt -%}<go>{%- endif -%}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    demo.write_tokenizer(d)
    return d


def _both(model_dir, template: str):
    ours = ModelTokenizer(model_dir)
    ours.chat_template, ours._template = template, None
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    theirs.chat_template = template
    return ours, theirs


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("gen", [True, False])
def test_the_demo_template_renders_tools_and_calls_as_transformers_does(model_dir, tools, gen):
    ours, theirs = _both(model_dir, demo.CHAT_TEMPLATE)
    want = theirs.apply_chat_template(
        CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=gen
    )
    assert ours.apply_chat_template(CONVERSATION, gen, tools=tools) == want
    if tools:  # the definitions and both calls are there, unescaped
        assert "Weather <now> & 'later'" in want and '"Zürich"' in want
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' in want


def test_the_demo_template_without_tools_renders_as_before(model_dir):
    """Plain chats keep the exact prompt they always had (the template's tool parts are off)."""
    ours = ModelTokenizer(model_dir)
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (
        ours.apply_chat_template(plain)
        == "<|begin|><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    )


def test_helpers_and_extra_variables_render_as_transformers_does(model_dir):
    ours, theirs = _both(model_dir, HELPERS_TEMPLATE)
    for tools in (None, TOOLS):
        want = theirs.apply_chat_template(
            CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True,
            enable_thinking=False,
        )  # fmt: skip
        got = ours.apply_chat_template(
            CONVERSATION, True, tools=tools, extra={"enable_thinking": False}
        )
        assert got == want
    assert "[assistant]" in want and "[tool]" not in want and "\\u00fc" in want


def test_raise_exception_is_the_requests_error_and_reserved_names_stay(model_dir):
    ours, _ = _both(model_dir, "{{ raise_exception('no user turn') }}")
    with pytest.raises(Exception, match="no user turn"):
        ours.apply_chat_template(CONVERSATION)
    with pytest.raises(RequestError, match="cannot be replaced.*messages"):
        ours.apply_chat_template(CONVERSATION, extra={"messages": []})


REASONING_TEMPLATE = (
    "{%- for m in messages -%}[{{ m['role'] }}|{{ m['thinking'] }}|{{ m['reasoning_content'] }}|"
    "{{ m['reasoning'] }}]{{ m['content'] }}{%- endfor -%}"
)


def test_a_messages_reasoning_reaches_the_template_under_transformers_names(model_dir):
    """An assistant's earlier reasoning, sent as reasoning_content, thinking or reasoning, is
    what transformers gives the template (gpt-oss's reads `thinking`)."""
    from services.gateway.chat_messages import ChatMessage

    ours, theirs = _both(model_dir, REASONING_TEMPLATE)
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r1"},
        {"role": "assistant", "content": "b", "reasoning": "r2"},
        {"role": "assistant", "content": "c", "thinking": "t3", "reasoning": "r3"},
    ]
    want = theirs.apply_chat_template(messages, tokenize=False)
    got = ours.apply_chat_template(
        [ChatMessage.model_validate(m).template_dict() for m in messages], False
    )
    assert got == want and "[assistant|t3|t3|r3]" in want


@pytest.mark.parametrize(
    "last",
    ["The answer is", "The answer is ", "  spaced  ", [{"type": "text", "text": "part one"}]],
)
@pytest.mark.parametrize("template", ["demo", "helpers"])
def test_continue_final_message_cuts_where_transformers_does(model_dir, last, template):
    """The prompt ends inside the last (assistant) message, as transformers' and vLLM's
    continue_final_message: its end-of-turn and anything after are gone."""
    ours, theirs = _both(model_dir, demo.CHAT_TEMPLATE if template == "demo" else HELPERS_TEMPLATE)
    msgs = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": last}]
    want = theirs.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours.apply_chat_template(msgs, False, continue_final=True) == want
    assert not want.endswith(("<|end|>", "<go>"))


def test_continue_final_message_refuses_what_it_cannot_continue(model_dir):
    ours = ModelTokenizer(model_dir)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]
    with pytest.raises(RequestError, match="no text to continue"):
        ours.apply_chat_template(msgs, False, continue_final=True)
    with pytest.raises(RequestError, match="cannot both be true"):
        ours.apply_chat_template(msgs, True, continue_final=True)
    ours.chat_template, ours._template = "{{ messages[0]['content'] }}", None
    msgs[1]["content"] = "not shown"
    with pytest.raises(RequestError, match="does not show the last message's text"):
        ours.apply_chat_template(msgs, False, continue_final=True)
