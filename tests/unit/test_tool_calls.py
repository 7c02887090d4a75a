"""Tool calls read out of a choice's text (services/gateway/tool_parsers.py, tool_calls.py):
the same content and calls whether the text comes whole, in two pieces split anywhere, or a
character at a time; what is not a call stays content, as the model wrote it."""

from __future__ import annotations

import json

import pytest

from services.gateway.tool_calls import CallStream, guide_schema, merge
from services.gateway.tool_parsers import (
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    HermesParser,
    MistralParser,
    ParsedCall,
    Step3Parser,
    ToolCallParser,
)

W = '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}'
CASES = [
    # (text, content, [(name, arguments)])
    ("plain text, no call <b>tag</b> <tool", "plain text, no call <b>tag</b> <tool", []),
    (f"<tool_call>{W}</tool_call>", "", [("get_weather", {"city": "Zürich", "days": 2})]),
    (
        f"Let me look.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>"
        '{"name": "noop", "arguments": "{}"}</tool_call>\n',
        "Let me look.",
        [("get_weather", {"city": "Zürich", "days": 2}), ("noop", {})],
    ),
    (f"<tool_call>{W}</tool_call>\n\nDone, thanks.", "Done, thanks.", [("get_weather", None)]),
    ("<tool_call>not json</tool_call> then text", "<tool_call>not json</tool_call> then text", []),
    ('<tool_call>["a list"]</tool_call>', '<tool_call>["a list"]</tool_call>', []),
    (f"cut off <tool_call>{W}", "cut off", [("get_weather", None)]),  # max_tokens
    ('cut off <tool_call>{"name": "get_w', 'cut off <tool_call>{"name": "get_w', []),
    ("trailing blanks stay  \n", "trailing blanks stay  \n", []),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', "", [("f", {"x": 1})]),
]


# DeepSeek's tags (special tokens of its tokenizer)
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
V3_W = f'{CALL}function{SEP}get_weather\n```json\n{{"city": "Zürich", "days": 2}}\n```{CALL_END}'
V31_W = f'{CALL}get_weather{SEP}{{"city": "Zürich", "days": 2}}{CALL_END}'
# Step-3's tags
S3_BEGIN, S3_END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
S3_CALL, S3_CALL_END, S3_SEP = "<｜tool_call_begin｜>", "<｜tool_call_end｜>", "<｜tool_sep｜>"
S3_W = (
    f'{S3_CALL}function{S3_SEP}<steptml:invoke name="get_weather">'
    '<steptml:parameter name="city"> Zürich &amp; co</steptml:parameter>'
    '<steptml:parameter name="days">2</steptml:parameter></steptml:invoke>'
    f"{S3_CALL_END}"
)
TAGGED_CASES = [
    # (parser, text, content, [(name, arguments)])
    (DeepSeekV3Parser, "no call, a ｜ bar", "no call, a ｜ bar", []),
    (DeepSeekV3Parser, f"Let me look.{BEGIN}{V3_W}{END}", "Let me look.",
     [("get_weather", {"city": "Zürich", "days": 2})]),
    (DeepSeekV3Parser,
     f"{BEGIN}{V3_W}\n{CALL}function{SEP}noop\n```json\n{{}}\n```{CALL_END}{END}",
     "", [("get_weather", None), ("noop", {})]),
    (DeepSeekV3Parser, f"{BEGIN}{CALL}function{SEP}f\nnot fenced{CALL_END}{END}",
     f"{CALL}function{SEP}f\nnot fenced{CALL_END}", []),
    (DeepSeekV3Parser, f"cut off {BEGIN}{CALL}function{SEP}get_w",
     f"cut off {CALL}function{SEP}get_w", []),
    (DeepSeekV31Parser, f"Sure.{BEGIN}{V31_W}{CALL}noop{SEP}{{}}{CALL_END}{END}", "Sure.",
     [("get_weather", {"city": "Zürich", "days": 2}), ("noop", {})]),
    (DeepSeekV31Parser, f"{BEGIN}{CALL}f{SEP}[1]{CALL_END}{END}", f"{CALL}f{SEP}[1]{CALL_END}", []),
    (DeepSeekV31Parser, "<｜tool▁call", "<｜tool▁call", []),  # held back, then let go
    # Mistral: [TOOL_CALLS] and the calls to the end, as a JSON list or NAME[ARGS]{...}
    (MistralParser, "no call [TOOL_CALL", "no call [TOOL_CALL", []),
    (MistralParser, 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": '
     '{"city": "Zürich", "days": 2}}, {"name": "noop", "arguments": {}}]', "Let me look.",
     [("get_weather", {"city": "Zürich", "days": 2}), ("noop", {})]),
    (MistralParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": 2}'
     "[TOOL_CALLS]noop[ARGS]{}", "", [("get_weather", {"city": "Zürich", "days": 2}),
                                      ("noop", {})]),
    (MistralParser, '[TOOL_CALLS][{"name": "get_w', '[TOOL_CALLS][{"name": "get_w', []),
    (MistralParser, "[TOOL_CALLS]noop[ARGS]{} and text", "[TOOL_CALLS]noop[ARGS]{} and text", []),
    # Step-3: steptml invokes between its own tags (values are text without a schema)
    (Step3Parser, "no call, a <steptml:invoke> word", "no call, a <steptml:invoke> word", []),
    (Step3Parser, f"Let me look.{S3_BEGIN}{S3_W}{S3_CALL}function{S3_SEP}"
     f'<steptml:invoke name="noop"></steptml:invoke>{S3_CALL_END}{S3_END}', "Let me look.",
     [("get_weather", {"city": "Zürich & co", "days": "2"}), ("noop", {})]),
    (Step3Parser, f"{S3_BEGIN}{S3_CALL}function{S3_SEP}<steptml:invoke name=\"f\">stray"
     f"</steptml:invoke>{S3_CALL_END}{S3_END}", f"{S3_CALL}function{S3_SEP}"
     '<steptml:invoke name="f">stray</steptml:invoke>' f"{S3_CALL_END}", []),
    (Step3Parser, f"cut off {S3_BEGIN}{S3_CALL}function{S3_SEP}<steptml:inv",
     f"cut off {S3_CALL}function{S3_SEP}<steptml:inv", []),
]  # fmt: skip


def _run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    content, calls = [], []
    for p in pieces:
        c, k = parser.feed(p)
        content.append(c)
        calls += k
    c, k = parser.finish()
    return "".join(content) + c, calls + k


def splits(text: str, step: int = 1):
    """The text whole, a character at a time, and in two pieces split every `step` characters
    (the reasoning and harmony readers' tests use it too)."""
    yield [text]
    yield list(text)
    for i in range(1, len(text), step):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize(
    "cls,text,content,calls", [(HermesParser, *c) for c in CASES] + TAGGED_CASES
)
def test_each_format_reads_the_same_calls_however_the_text_is_split(cls, text, content, calls):
    for pieces in splits(text):
        got_content, got_calls = _run(cls(), pieces)
        assert got_content == content, pieces
        assert [c.name for c in got_calls] == [n for n, _ in calls], pieces
        for c, (_, args) in zip(got_calls, calls, strict=True):
            if args is not None:
                assert json.loads(c.arguments) == args


def test_hermes_holds_back_only_what_may_become_a_call():
    p = HermesParser()
    assert p.feed("Hello <to") == ("Hello", [])  # the blank and "<to" may be a call's
    assert p.feed("ol> is a word") == (" <tool> is a word", [])
    assert p.feed("\n") == ("", [])
    assert p.finish() == ("\n", [])


def _stream(mode: str, pieces: list[str], **kw) -> tuple[str, list[dict], list[list[dict]], str]:
    s = CallStream(mode, "hermes", **kw)
    content, deltas, chunks = "", [], []
    for i, piece in enumerate(pieces):
        c, d = s.feed(piece, final=i == len(pieces) - 1)
        content += c
        deltas += d
        chunks.append(d)
    return content, merge(deltas), chunks, s.finish_reason("stop")


def test_auto_numbers_calls_and_ends_with_tool_calls():
    text = f"<tool_call>{W}</tool_call><tool_call>{W}</tool_call>"
    content, calls, _, finish = _stream("auto", [text[:30], text[30:], ""])
    assert content == "" and finish == "tool_calls" and len(calls) == 2
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")
    assert calls[1]["function"]["name"] == "get_weather"
    _, calls, _, _ = _stream("auto", [text, ""], parallel=False)
    assert len(calls) == 1  # parallel_tool_calls false: the first call only
    content, calls, _, finish = _stream("auto", ["no calls", ""])
    assert (content, calls, finish) == ("no calls", [], "stop")


def test_named_streams_the_arguments_as_they_come():
    content, calls, chunks, finish = _stream("named", ['{"city"', "", ': "Oslo"}', ""], name="f")
    assert content == "" and finish == "stop"  # OpenAI keeps "stop" for a named function
    assert calls == [
        {
            "id": calls[0]["id"],
            "type": "function",
            "function": {"name": "f", "arguments": '{"city": "Oslo"}'},
        }
    ]
    assert chunks[0][0]["function"]["name"] == "f" and chunks[1] == []
    assert chunks[2] == [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]
    _, calls, _, _ = _stream("named", [""], name="f")  # nothing generated: still one call
    assert calls[0]["function"] == {"name": "f", "arguments": ""}


def test_required_reads_the_guided_array_at_the_end():
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    content, calls, chunks, finish = _stream("required", [text[:10], text[10:]])
    assert chunks[0] == [] and content == "" and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    content, calls, _, finish = _stream("required", ['[{"name": "a", "argu'])
    assert content == '[{"name": "a", "argu' and calls == [] and finish == "stop"


def test_guide_schemas():
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "b"}},
    ]
    assert guide_schema(tools, "a", True) == {"type": "object"}
    assert guide_schema(tools, "c", True) is None
    s = guide_schema(tools, "", False)
    assert s["maxItems"] == 1 and s["minItems"] == 1
    names = [i["properties"]["name"]["enum"] for i in s["items"]["anyOf"]]
    assert names == [["a"], ["b"]]
    assert "maxItems" not in guide_schema(tools, "", True)


def test_mistral_calls_come_one_by_one_as_each_is_closed_by_the_next():
    p = MistralParser()
    assert p.feed("Sure.[TOOL_CALLS]get_weather[ARGS]") == ("Sure.", [])
    assert p.feed('{"city": "Oslo"}') == ("", [])  # not known whole yet: more may follow
    content, calls = p.feed("[TOOL_CALLS]noo")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert p.feed("p[ARGS]{}") == ("", [])
    content, calls = p.finish()
    assert content == "" and [c.name for c in calls] == ["noop"]


def test_mistral_calls_get_the_nine_character_ids_its_templates_want():
    s = CallStream("auto", "mistral")
    _, deltas = s.feed('[TOOL_CALLS][{"name": "noop", "arguments": {}}]', final=True)
    (call,) = deltas
    assert len(call["id"]) == 9 and call["id"].isalnum()
    _, (hermes,) = CallStream("auto", "hermes").feed(
        '<tool_call>{"name": "noop", "arguments": {}}</tool_call>', final=True
    )
    assert hermes["id"].startswith("call_")


def test_step3_types_its_text_arguments_by_the_tools_schema():
    params = {
        "type": "object",
        "properties": {
            "days": {"type": "integer"}, "t": {"type": "number"}, "on": {"type": "boolean"},
            "tags": {"type": "array"}, "where": {"type": "object"}, "name": {"type": "string"},
            "bad": {"type": "integer"},
        },
    }  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    values = {"days": "3", "t": "1.5", "on": "True", "tags": '["a", 1]', "where": '{"x": 1}',
              "name": " 42 ", "bad": "many", "other": "7"}  # fmt: skip
    body = "".join(
        f'<steptml:parameter name="{k}">{v}</steptml:parameter>' for k, v in values.items()
    )
    text = f'{S3_BEGIN}{S3_CALL}function{S3_SEP}<steptml:invoke name="f">{body}</steptml:invoke>'
    s = CallStream("auto", "step3", tools=tools)
    content, deltas = s.feed(text + f"{S3_CALL_END}{S3_END}", final=True)
    (call,) = merge(deltas)
    assert content == "" and call["function"]["name"] == "f"
    assert json.loads(call["function"]["arguments"]) == {
        "days": 3, "t": 1.5, "on": True, "tags": ["a", 1], "where": {"x": 1}, "name": "42",
        "bad": "many", "other": "7",
    }  # fmt: skip
