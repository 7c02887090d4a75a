"""Structured-output request fields as pydantic models (OpenAI's response_format, vLLM's
structured_outputs) and the one (kind, guide) pair a request's fields come to, as
afd.sampling.SamplingParams carries it to the attention server's guides.

vLLM's structural tag is sent on as xgrammar's own form, `{"type": "structural_tag",
"format": ...}`; its older form (tags, each a begin string, a JSON schema and an end string,
opened by triggers) is written in that form here, so the engine compiles one kind of text."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from services.gateway.schema_base import Bool
from services.gateway.schema_base import Model as _Model

GuideText = Annotated[str, Field(min_length=1)]  # a schema, regex or grammar as text


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Bool | None = None


class TagStructure(_Model):
    """One tag of vLLM's older structural tag: JSON fitting `schema` between begin and end."""

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(_Model):
    """OpenAI's: free text, any JSON object, or JSON that fits a schema; vLLM's structural
    tag: free text in which tags (opened by their triggers) hold what they say."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None  # a structural tag's, in xgrammar's form
    structures: Annotated[list[TagStructure], Field(min_length=1)] | None = None  # older form
    triggers: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = (
        None
    )

    @model_validator(mode="after")
    def _complete(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        if self.type == "structural_tag":
            older = self.structures is not None or self.triggers is not None
            if (self.format is None) == (self.structures is None or self.triggers is None):
                raise ValueError(
                    "response_format of type structural_tag needs either a format or "
                    "structures and triggers" + (" (both)" if older else "")
                )
        return self

    def structural_tag(self) -> str:
        if self.format is not None:
            return json.dumps({"type": "structural_tag", "format": self.format})
        assert self.structures is not None and self.triggers is not None
        return _from_older([s.model_dump(by_alias=True) for s in self.structures], self.triggers)


class StructuredOutputs(_Model):
    """vLLM's: exactly one of these."""

    json_: dict[str, Any] | GuideText | None = Field(default=None, alias="json")
    regex: GuideText | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: GuideText | None = None
    json_object: Bool | None = None
    structural_tag: GuideText | None = None  # as JSON text, either form


def structural_tag(text: str) -> str:
    """A structural tag given as text (structured_outputs'), in xgrammar's form; ValueError
    for text that is neither form."""
    try:
        tag = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise ValueError("structured_outputs.structural_tag is not valid JSON") from None
    if isinstance(tag, dict) and "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        fields = ("begin", "schema", "end")
        if not (
            isinstance(structures, list)
            and structures
            and all(isinstance(s, dict) and all(f in s for f in fields) for s in structures)
            and isinstance(triggers, list)
            and triggers
            and all(isinstance(t, str) and t for t in triggers)
        ):
            raise ValueError(
                "a structural tag's structures are objects with begin, schema and end, and its "
                "triggers a list of strings"
            )
        return _from_older(structures, triggers)
    if isinstance(tag, dict) and isinstance(tag.get("format"), dict):
        return json.dumps({"type": "structural_tag", "format": tag["format"]})
    raise ValueError(
        'a structural tag is {"type": "structural_tag", "format": {...}} or '
        '{"structures": [...], "triggers": [...]}'
    )


def _from_older(structures: list[dict[str, Any]], triggers: list[str]) -> str:
    tags = [
        {
            "type": "tag",
            "begin": s["begin"],
            "content": {"type": "json_schema", "json_schema": s["schema"]},
            "end": s["end"],
        }
        for s in structures
    ]
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return json.dumps({"type": "structural_tag", "format": fmt})


def guides(
    response_format: ResponseFormat | None,
    structured: StructuredOutputs | None,
    legacy: dict[str, Any],  # vLLM's older guided_* fields, by name
) -> list[tuple[str, str]]:
    """Every (kind, guide) the request's fields ask for (more than one is the caller's 400)."""

    def schema(v: dict[str, Any] | str) -> str:
        return v if isinstance(v, str) else json.dumps(v)

    out = []
    rf = response_format
    if rf is not None and rf.type == "json_object":
        out.append(("json_object", ""))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        out.append(("json", schema(rf.json_schema.schema_)))
    elif rf is not None and rf.type == "structural_tag":
        out.append(("structural_tag", rf.structural_tag()))
    so = structured
    if so is not None:
        out += [("json", schema(so.json_))] if so.json_ is not None else []
        out += [("regex", so.regex)] if so.regex is not None else []
        out += [("choice", json.dumps(so.choice))] if so.choice is not None else []
        out += [("grammar", so.grammar)] if so.grammar is not None else []
        out += [("json_object", "")] if so.json_object else []
        if so.structural_tag is not None:
            out.append(("structural_tag", structural_tag(so.structural_tag)))
    g = legacy
    out += [("json", schema(g["guided_json"]))] if g.get("guided_json") is not None else []
    out += [("regex", g["guided_regex"])] if g.get("guided_regex") is not None else []
    out += [("choice", json.dumps(g["guided_choice"]))] if g.get("guided_choice") else []
    out += [("grammar", g["guided_grammar"])] if g.get("guided_grammar") is not None else []
    return out
