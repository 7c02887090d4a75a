"""Structured outputs (services/attention/guides.py): afd's greedy tokens under each kind of
guide against transformers generating from the same checkpoint (float32, with a byte-level
tokenizer written beside it) through xgrammar's own transformers logits processor, compiled
from the same guide; JSON answers parse and fit their schema."""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from afd.control import SamplingParams  # noqa: E402 - after the skip
from afd.demo import EOS_TOKEN_ID, write_tokenizer  # noqa: E402
from afd.errors import RequestError  # noqa: E402
from afd_cli.local import local_engine  # noqa: E402
from tests.helpers.checkpoints import hf_model, qwen3_moe  # noqa: E402
from tests.integration.test_engine_reference import engine_cfg  # noqa: E402

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 57)), [7, 7, 7]]
NEW = 40
# The random model likes JSON's optional whitespace better than its content: both sides bias
# whitespace bytes out (the grammar still lets a required space through)
NO_SPACE = tuple((b, -100.0) for b in b"\t\n\r ")
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
    "required": ["kind", "ok"],
    "additionalProperties": False,
}
GUIDES = {
    "json": json.dumps(SCHEMA),
    "json_object": "",
    "regex": r"(yes|no), [a-z]{2,6}\.",
    "choice": json.dumps(["left", "right", 'up "high"']),
    "grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] [0-9]?',
    # vLLM's structural tag in xgrammar's form (the gateway writes the older form so): a
    # tool-call-like tag holding JSON of the schema, one and only one
    "structural_tag": json.dumps(
        {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": ["<f"],
                "at_least_one": True,
                "stop_after_first": True,
                "tags": [
                    {
                        "type": "tag",
                        "begin": "<f>",
                        "end": "</f>",
                        "content": {"type": "json_schema", "json_schema": SCHEMA},
                    }
                ],
            },
        }
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = qwen3_moe(tmp_path_factory.mktemp("guided") / "ckpt", eos_token_id=EOS_TOKEN_ID)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=384, stop_token_ids=[EOS_TOKEN_ID])
    return hf_model(ckpt, torch.float32), tok, xgr.GrammarCompiler(info)


def _compile(compiler, kind: str, guide: str):
    if kind == "json":
        return compiler.compile_json_schema(guide)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}')
    if kind == "regex":
        return compiler.compile_regex(guide)
    if kind == "choice":
        return compiler.compile_grammar(
            "root ::= " + " | ".join(map(json.dumps, json.loads(guide)))
        )
    if kind == "structural_tag":
        return compiler.compile_structural_tag(guide)
    return compiler.compile_grammar(guide)


def _reference(hf, kind: str) -> list[list[int]]:
    model, _, compiler = hf
    outs = []
    for p in PROMPTS:
        proc = xgr.contrib.hf.LogitsProcessor(_compile(compiler, kind, GUIDES[kind]))
        o = model.generate(
            torch.tensor([p]), max_new_tokens=NEW, do_sample=False, logits_processor=[proc],
            pad_token_id=EOS_TOKEN_ID, sequence_bias={(t,): b for t, b in NO_SPACE},
        )  # fmt: skip
        out = o[0, len(p) :].tolist()
        if EOS_TOKEN_ID in out:  # transformers pads after EOS
            out = out[: out.index(EOS_TOKEN_ID) + 1]
        outs.append(out)
    return outs


@pytest.mark.parametrize("kind", list(GUIDES))
def test_guided_greedy_matches_transformers_with_xgrammar(ckpt, hf, kind):
    ref = _reference(hf, kind)
    sp = SamplingParams(
        max_tokens=NEW, temperature=0, guide_kind=kind, guide=GUIDES[kind], logit_bias=NO_SPACE
    )
    with local_engine(engine_cfg(ckpt), 1, progress=False) as eng:
        reqs = eng.generate(PROMPTS, sp)
        assert not eng.runner.guides.active, "matchers leaked"
    assert [r.output_token_ids for r in reqs] == ref
    tok = hf[1]
    texts = [tok.decode(r.output_token_ids, skip_special_tokens=True) for r in reqs]
    ended = [r.finish_reason == "stop" for r in reqs]
    if kind == "json":
        for text, done in zip(texts, ended, strict=True):
            if done:  # a complete answer: it fits the schema
                obj = json.loads(text)
                assert set(obj) == {"kind", "ok"} and obj["kind"] in ("cat", "dog")
                assert isinstance(obj["ok"], bool)
        assert any(ended), texts
    if kind == "choice":
        assert all(t in json.loads(GUIDES["choice"]) for t in texts) and all(ended), texts
    if kind == "structural_tag":  # the tag, its JSON, its end, and nothing after
        for text in texts:
            assert text.startswith("<f>") and text.endswith("</f>"), texts
            obj = json.loads(text[3:-4])
            assert set(obj) == {"kind", "ok"} and obj["kind"] in ("cat", "dog")
        assert all(ended), texts


def test_a_guide_that_does_not_compile_is_the_requests_error(ckpt):
    with local_engine(engine_cfg(ckpt), 1, progress=False) as eng:
        for kind, guide in [("json", "{not json"), ("regex", "(unclosed"), ("grammar", "x ::=")]:
            with pytest.raises(RequestError, match=f"the {kind} guide does not compile"):
                eng.add_request([1, 2], SamplingParams(guide_kind=kind, guide=guide))
        # compiling grows steeply with nesting: a schema nested too deep is refused unread
        deep = '{"type":"object","properties":{"a":' * 70 + "{}" + "}}" * 70
        with pytest.raises(RequestError, match="nests 141 levels deep; at most 64"):
            eng.add_request([1, 2], SamplingParams(guide_kind="json", guide=deep))
        assert not eng.runner.guides.active and not eng.has_unfinished()


def test_a_grammar_with_no_end_token_ends_the_request_when_complete(ckpt, hf):
    """With ignore_eos (and no stop tokens) nothing can end the output but the grammar: it
    ends as the text completes, with no EOS. transformers' tokens are the same less its EOS."""
    ref = _reference(hf, "choice")
    sp = SamplingParams(
        max_tokens=NEW, temperature=0, guide_kind="choice", guide=GUIDES["choice"],
        logit_bias=NO_SPACE, ignore_eos=True,
    )  # fmt: skip
    with local_engine(engine_cfg(ckpt), 1, progress=False) as eng:
        reqs = eng.generate(PROMPTS, sp)
    assert [r.output_token_ids + [EOS_TOKEN_ID] for r in reqs] == ref
    assert all(r.finish_reason == "stop" for r in reqs)


def test_logprobs_under_a_grammar_stay_finite(ckpt):
    """Tokens the grammar masks out read -9999 (as vLLM reports them), never -inf."""
    sp = SamplingParams(max_tokens=4, guide_kind="choice", guide='["ab", "cd"]', logprobs=5)
    with local_engine(engine_cfg(ckpt), 1, progress=False) as eng:
        (req,) = eng.generate(PROMPTS[:1], sp)
    assert req.output_logprobs
    for lp in req.output_logprobs:
        values = [lp.logprob] + [v for _, v in lp.top]
        assert all(-9999.0 <= v <= 0.0 for v in values), values
        assert min(values) == -9999.0  # 5 alternatives, at most 2 allowed


class _After:
    """transformers' side of a guide that waits: nothing until the output holds `marker`,
    then xgrammar's own processor, made at that point (it takes the tokens from there on)."""

    def __init__(self, compiled, prompt_len: int, marker: list[int]):
        self.compiled, self.prompt_len, self.marker, self.proc = compiled, prompt_len, marker, None

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len :].tolist()
        if self.proc is None and any(
            out[i : i + len(self.marker)] == self.marker for i in range(len(out))
        ):
            self.proc = xgr.contrib.hf.LogitsProcessor(self.compiled)
        return scores if self.proc is None else self.proc(input_ids, scores)


def test_a_guide_that_waits_holds_from_the_token_after_its_marker(ckpt, hf):
    """guide_after (a thinking model's end of reasoning): the output is free, token for token
    the unguided one, until it holds the marker (the first pair of tokens from the free
    output's fourth on that it has not held before), and from the next token it is
    transformers' under xgrammar's processor made at that point."""
    model, _, compiler = hf
    free = SamplingParams(max_tokens=NEW, temperature=0, logit_bias=NO_SPACE)
    with local_engine(engine_cfg(ckpt), 1, progress=False) as eng:
        unguided = [r.output_token_ids for r in eng.generate(PROMPTS, free)]
    for p, out in zip(PROMPTS, unguided, strict=True):
        k = next(k for k in range(3, NEW - 8) if out[k : k + 2] not in _pairs(out[: k + 1]))
        marker = out[k : k + 2]
        proc = _After(_compile(compiler, "json", GUIDES["json"]), len(p), marker)
        o = model.generate(
            torch.tensor([p]), max_new_tokens=NEW, do_sample=False, logits_processor=[proc],
            pad_token_id=EOS_TOKEN_ID, sequence_bias={(t,): b for t, b in NO_SPACE},
        )  # fmt: skip
        ref = o[0, len(p) :].tolist()
        if EOS_TOKEN_ID in ref:
            ref = ref[: ref.index(EOS_TOKEN_ID) + 1]
        sp = SamplingParams(
            max_tokens=NEW, temperature=0, guide_kind="json", guide=GUIDES["json"],
            logit_bias=NO_SPACE, guide_after=tuple(marker),
        )  # fmt: skip
        with local_engine(engine_cfg(ckpt), 1, progress=False) as eng:
            (req,) = eng.generate([p], sp)
            assert not eng.runner.guides.active, "matchers leaked"
        assert req.output_token_ids == ref
        assert ref[: k + 2] == out[: k + 2] and ref != out[: len(ref)]  # free, then guided
        tail = hf[1].decode(ref[k + 2 :], skip_special_tokens=True)
        assert tail.lstrip().startswith("{"), tail


def _pairs(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + 2] for i in range(len(ids) - 1)]


@pytest.mark.parametrize("kind", list(GUIDES))
def test_guided_drafts_keep_transformers_tokens(ckpt, hf, kind):
    """Speculative decoding under a guide: each draft row is masked for the grammar's state
    after the drafts before it, so greedy tokens are still transformers' with xgrammar, and a
    grammar completed by a kept draft ends the output there."""
    from dataclasses import replace

    from afd.config import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    sp = SamplingParams(
        max_tokens=NEW, temperature=0, guide_kind=kind, guide=GUIDES[kind], logit_bias=NO_SPACE
    )
    kept = drafted = 0
    with local_engine(replace(engine_cfg(ckpt), speculative=spec), 1, progress=False) as eng:
        reqs = [eng.add_request(p, sp) for p in PROMPTS]
        while eng.has_unfinished():
            result = eng.step()
            drafted, kept = drafted + result.drafts[1], kept + result.drafts[2]
        assert not eng.runner.guides.active, "matchers leaked"
    assert [r.output_token_ids for r in reqs] == _reference(hf, kind)
    assert drafted > 0
    SPEC_KEPT[kind] = kept


SPEC_KEPT: dict[str, int] = {}


def test_some_guided_drafts_were_kept():
    """(after the test above, over every kind): drafts were kept, not only verified."""
    if len(SPEC_KEPT) < len(GUIDES):
        pytest.skip("runs after test_guided_drafts_keep_transformers_tokens for every kind")
    assert sum(SPEC_KEPT.values()) > 0, SPEC_KEPT
