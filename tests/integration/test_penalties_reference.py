"""Logit biases and repetition, frequency and presence penalties: afd's greedy tokens against
transformers generating from the same checkpoint (float32) with its own logits processors:
`sequence_bias` for logit_bias and `repetition_penalty` (the same definition as vLLM's), and
OpenAI's documented formula for frequency and presence penalties (transformers has none) as a
logits processor on the tokens generated so far. transformers applies them in that order, as
afd does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from afd.control import SamplingParams
from afd.errors import ErrorCode, RequestError
from afd_cli.local import local_engine
from tests.helpers.checkpoints import hf_greedy, hf_model
from tests.integration.test_engine_reference import engine_cfg

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 57)), [7, 7, 7], list(range(100, 119))]
NEW = 16


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition: each logit less frequency x its token's count in the output and
    presence once if the output holds it (the prompt does not count)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


@pytest.fixture(scope="module")
def hf(qwen3_dir):
    return hf_model(qwen3_dir, torch.float32)


@pytest.fixture(scope="module")
def plain(hf):
    return hf_greedy(hf, PROMPTS, NEW)


def hf_penalized(model, bias=(), repetition=1.0, frequency=0.0, presence=0.0):
    outs = []
    for p in PROMPTS:
        extra = {}
        if bias:
            extra["sequence_bias"] = {(t,): b for t, b in bias}
        if repetition != 1.0:
            extra["repetition_penalty"] = repetition
        if frequency or presence:
            extra["logits_processor"] = LogitsProcessorList(
                [OpenAIPenalties(len(p), frequency, presence)]
            )
        o = model.generate(
            torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **extra
        )
        outs.append(o[0, len(p) :].tolist())
    return outs


def afd_penalized(path, **sampling):
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, **sampling)
    with local_engine(engine_cfg(path), 1, progress=False) as eng:
        return [r.output_token_ids for r in eng.generate(PROMPTS, sp)]


def _bias(plain):
    """Push the plain greedy run's favourite token out, and a token it never chose in."""
    first = plain[2][0]
    never = next(t for t in range(300, 400) if all(t not in o for o in plain))
    return ((first, -100.0), (never, 2.5))


@pytest.mark.parametrize(
    "case",
    ["bias", "repetition", "frequency", "presence", "all"],
)
def test_greedy_with_penalties_matches_transformers(qwen3_dir, hf, plain, case):
    kw = {
        "bias": {"bias": _bias(plain)},
        "repetition": {"repetition": 1.6},
        "frequency": {"frequency": 0.8},
        "presence": {"presence": 1.5},
        "all": {"bias": _bias(plain), "repetition": 1.3, "frequency": 0.5, "presence": 0.5},
    }[case]
    ref = hf_penalized(hf, **kw)
    assert ref != plain, "the penalty changes nothing on these prompts: the test proves nothing"
    names = {"bias": "logit_bias", "repetition": "repetition_penalty"}
    names |= {"frequency": "frequency_penalty", "presence": "presence_penalty"}
    got = afd_penalized(qwen3_dir, **{names[k]: v for k, v in kw.items()})
    assert got == ref


def test_token_ids_outside_the_vocabulary_are_refused_and_the_engine_serves_on(qwen3_dir, plain):
    """The gateway checks token ids too, but a control-plane client may not: a bad id must be
    the request's error, not a failed step that takes every other request with it."""
    with local_engine(engine_cfg(qwen3_dir), 1, progress=False) as eng:
        V = eng.cfg.model.vocab_size
        with pytest.raises(RequestError, match=f"prompt token id {V} is out of range"):
            eng.add_request([1, V])
        with pytest.raises(RequestError, match="prompt token id -1"):
            eng.add_request([-1])
        with pytest.raises(RequestError, match=f"logit_bias token id {V + 3}"):
            eng.add_request([1], SamplingParams(logit_bias=((V + 3, 1.0),)))
        with pytest.raises(RequestError, match=f"{V + 1} logprobs asked for"):
            eng.add_request([1], SamplingParams(logprobs=V + 1))
        sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        assert [r.output_token_ids for r in eng.generate(PROMPTS, sp)] == plain


def test_min_tokens_holds_off_eos_and_stop_tokens_as_transformers_min_new_tokens(qwen3_dir, hf):
    """A token made the greedy choice (+100) that ends the output, as the model's EOS or as a
    stop token: transformers' min_new_tokens (with that token as its EOS) keeps it out for 5
    tokens, and so does afd's min_tokens."""
    end = 333
    ref = []
    for p in PROMPTS:
        o = hf.generate(
            torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=5, do_sample=False,
            eos_token_id=end, pad_token_id=0, sequence_bias={(end,): 100.0},
        )  # fmt: skip
        ref.append(o[0, len(p) :].tolist())
    assert all(len(r) == 6 and r[-1] == end for r in ref), ref
    base = engine_cfg(qwen3_dir)
    as_eos = replace(base, model=replace(base.model, eos_token_ids=(end,)))
    bias = ((end, 100.0),)
    for cfg, sp in [
        (as_eos, SamplingParams(max_tokens=NEW, temperature=0, min_tokens=5, logit_bias=bias)),
        (base, SamplingParams(
            max_tokens=NEW, temperature=0, min_tokens=5, logit_bias=bias, stop_token_ids=(end,),
            ignore_eos=True,
        )),
    ]:  # fmt: skip
        with local_engine(cfg, 1, progress=False) as eng:
            reqs = eng.generate(PROMPTS, sp)
        assert [r.output_token_ids for r in reqs] == ref
        assert all(r.finish_reason == "stop" for r in reqs)


def test_bad_words_and_allowed_tokens_match_transformers(qwen3_dir, hf, plain):
    """vLLM's bad_words against transformers' bad_words_ids (a one-token word never chosen,
    a two-token word's last token never right after its first), and allowed_token_ids against
    transformers' prefix_allowed_tokens_fn. The two-token word's first token ends no prompt
    (transformers also matches across the prompt, vLLM and afd in the output only)."""
    one = plain[0][2]
    first, last = next(
        (o[i], o[i + 1])
        for o in plain
        for i in range(len(o) - 1)
        if o[i] != one and o[i + 1] != one and all(p[-1] != o[i] for p in PROMPTS)
    )
    words = ((one,), (first, last))
    allowed = tuple(sorted({t for o in plain for t in o[1:4]} | {7, 250}))
    refs = {"bad": [], "allowed": []}
    for p in PROMPTS:
        for kind, extra in [
            ("bad", {"bad_words_ids": [list(w) for w in words]}),
            ("allowed", {"prefix_allowed_tokens_fn": lambda _b, _ids: list(allowed)}),
        ]:
            o = hf.generate(
                torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                **extra,
            )  # fmt: skip
            refs[kind].append(o[0, len(p) :].tolist())
    assert refs["bad"] != plain and refs["allowed"] != plain
    assert all(t in allowed for o in refs["allowed"] for t in o)
    assert afd_penalized(qwen3_dir, bad_words=words) == refs["bad"]
    assert afd_penalized(qwen3_dir, allowed_token_ids=allowed) == refs["allowed"]
    with local_engine(engine_cfg(qwen3_dir), 1, progress=False) as eng:
        V = eng.cfg.model.vocab_size
        for name, sp in [
            ("bad_words", SamplingParams(bad_words=((1, V),))),
            ("allowed_token_ids", SamplingParams(allowed_token_ids=(V,))),
            ("stop_token_ids", SamplingParams(stop_token_ids=(V + 1,), min_tokens=1)),
        ]:
            with pytest.raises(RequestError, match=f"{name} token id"):
                eng.add_request([1], sp)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_left_no_token_fails_alone(qwen3_dir, plain, temperature):
    """allowed_token_ids and bad_words that share no token leave the request nothing to
    choose: it ends with its own 400-class error (a sampled row of all -inf used to fail
    torch.multinomial, and with it the step of every request beside it), the others' tokens
    stay transformers'."""
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    none_left = SamplingParams(
        max_tokens=NEW, temperature=temperature, allowed_token_ids=(7,), bad_words=((7,),)
    )
    with local_engine(engine_cfg(qwen3_dir), 1, progress=False) as eng:
        reqs = [eng.add_request(p, sp) for p in PROMPTS[:2]]
        bad = eng.add_request(PROMPTS[2], none_left)
        reqs += [eng.add_request(PROMPTS[3], sp)]
        while eng.has_unfinished():
            eng.step()
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert bad.finish_reason == "error" and bad.output_token_ids == []
    assert bad.error_code is ErrorCode.INVALID_REQUEST and "no token can be chosen" in bad.error
    assert [r.output_token_ids for r in reqs] == plain[:2] + plain[3:]
