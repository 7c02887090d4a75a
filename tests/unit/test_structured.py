"""Structured-output fields of a request to the one (kind, guide) the engine compiles
(services/gateway/structured.py): every form of every kind, and vLLM's structural tag in
both of its forms, the older one written as xgrammar itself converts it."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TAG = {"begin": "<function=weather>", "schema": SCHEMA, "end": "</function>"}
OLDER = {"structures": [TAG], "triggers": ["<function="]}
NEWER = {"type": "triggered_tags", "triggers": ["<f"], "tags": [
    {"type": "tag", "begin": "<f>", "content": {"type": "const_string", "value": "x"},
     "end": "</f>"}]}  # fmt: skip


def _guide(**fields) -> tuple[str, str]:
    return CompletionRequest(prompt="x", **fields).guide


@pytest.mark.parametrize(
    "fields, kind",
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "json"),
        ({"structured_outputs": {"json": SCHEMA}}, "json"),
        ({"structured_outputs": {"regex": "a+"}}, "regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object"),
        ({"guided_json": SCHEMA}, "json"),
        ({"guided_regex": "a+"}, "regex"),
        ({"guided_choice": ["a"]}, "choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar"),
        ({"response_format": {"type": "structural_tag", **OLDER}}, "structural_tag"),
        ({"response_format": {"type": "structural_tag", "format": NEWER}}, "structural_tag"),
        ({"structured_outputs": {"structural_tag": json.dumps(OLDER)}}, "structural_tag"),
        ({"response_format": {"type": "text"}}, ""),
    ],
)
def test_each_form_comes_to_its_kind(fields, kind):
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    assert _guide(**fields)[0] == chat.guide[0] == kind


def test_a_structural_tag_is_sent_in_xgrammars_form_whichever_form_it_came_in():
    xgr = pytest.importorskip("xgrammar")
    own = xgr.StructuralTag.from_legacy_structural_tag(
        [xgr.StructuralTagItem(begin=TAG["begin"], schema=SCHEMA, end=TAG["end"])],
        OLDER["triggers"],
    )
    for fields in (
        {"response_format": {"type": "structural_tag", **OLDER}},
        {"structured_outputs": {"structural_tag": json.dumps(OLDER)}},
    ):
        assert xgr.StructuralTag.model_validate_json(_guide(**fields)[1]) == own
    newer = {"type": "structural_tag", "format": NEWER}
    for fields in (
        {"response_format": newer},
        {"structured_outputs": {"structural_tag": json.dumps(newer)}},
    ):
        sent = json.loads(_guide(**fields)[1])
        assert sent == newer and xgr.StructuralTag.model_validate(sent)


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "structural_tag"}},
        {"response_format": {"type": "structural_tag", "structures": [TAG]}},
        {"response_format": {"type": "structural_tag", "format": NEWER, **OLDER}},
        {
            "response_format": {
                "type": "structural_tag",
                "structures": [{"begin": "<f>"}],
                "triggers": ["<"],
            }
        },  # fmt: skip
        {"structured_outputs": {"structural_tag": "{"}},
        {"structured_outputs": {"structural_tag": '{"structures": [], "triggers": ["<"]}'}},
        {"structured_outputs": {"structural_tag": '["x"]'}},
        {"structured_outputs": {"regex": "a"}, "guided_regex": "b"},
    ],
)
def test_a_malformed_or_doubled_guide_is_refused(fields):
    with pytest.raises(ValidationError):
        _guide(**fields)
