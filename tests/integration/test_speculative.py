"""Speculative decoding (n-gram drafts) against transformers: a greedy request's tokens are the
reference's whatever its drafts, for every family transformers runs, in float32 with an fp32
wire, with micro-batches, chunked prefill, preemption and prefix caching in the way.

Greedy tokens fix the drafts too: a request's drafts come from its prompt and the reference's
tokens so far, and a draft is kept exactly when it is the reference's next token. So the drafts
verified and kept over a run are known in advance (`expected_drafts`), and the engine must
report exactly those: a test cannot pass by never drafting, or by keeping too few."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from afd.config import SpeculativeConfig
from afd.control import SamplingParams
from afd_cli.local import local_engine
from services.attention.request import Request
from services.attention.speculative import NgramDrafter, room
from tests.helpers.checkpoints import (
    REFERENCE_CHECKPOINTS,
    TRANSFORMERS_REFERENCED,
    hf_greedy,
    hf_model,
)
from tests.integration.test_engine_reference import engine_cfg

# text that repeats, as code edits and quoted documents do: drafts come from the prompt
PROMPTS = [
    [5, 9, 17, 3, 250, 41, 5, 9, 17, 3, 250, 41, 5, 9],
    list(range(20, 40)) + list(range(20, 31)),
    [7, 7, 7],
    [100, 101, 102, 103] * 4,
]
NEW = 24
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """model_type -> (checkpoint, transformers' float32 greedy tokens)."""
    out = {}
    for model_type in TRANSFORMERS_REFERENCED:
        path = REFERENCE_CHECKPOINTS[model_type](tmp_path_factory.mktemp(model_type) / "ckpt")
        out[model_type] = (path, hf_greedy(hf_model(path, torch.float32), PROMPTS, NEW))
    return out


def expected_drafts(prompts, ref, cfg: SpeculativeConfig) -> tuple[int, int]:
    """(drafts verified, drafts kept) of a run whose steps never cut a request's drafts short
    (a budget large enough for all), from the reference tokens alone."""
    drafter, drafted, kept = NgramDrafter(cfg), 0, 0
    for i, (prompt, want) in enumerate(zip(prompts, ref, strict=True)):
        req = Request(f"r{i}", list(prompt), SamplingParams(max_tokens=NEW, temperature=0))
        req.output_token_ids = want[:1]  # the prefill's token: no drafts before it
        while len(req.output_token_ids) < NEW:
            at = len(req.output_token_ids)
            drafts = drafter.propose(req, room(req, 1 << 20))
            n = 0
            while n < len(drafts) and drafts[n] == want[at + n]:
                n += 1
            drafted, kept = drafted + len(drafts), kept + n
            if drafts:
                drafter.verified(req.request_id, len(drafts), n)
            req.output_token_ids = want[: at + n + 1]
    return drafted, kept


def spec_greedy(cfg, prompts=PROMPTS, arrive_late: int = 0):
    """Tokens per prompt, and the drafts verified and kept over the run; with arrive_late the
    last prompts join after a few steps (to meet running requests that draft)."""
    drafted = kept = 0
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    with local_engine(cfg, 1, progress=False) as eng:
        first = prompts[: len(prompts) - arrive_late]
        reqs = [eng.add_request(p, sp) for p in first]
        steps = 0
        while eng.has_unfinished() or len(reqs) < len(prompts):
            if steps == 3:
                reqs += [eng.add_request(p, sp) for p in prompts[len(first) :]]
            result = eng.step()
            drafted += result.drafts[1]
            kept += result.drafts[2]
            steps += 1
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks, "KV blocks leaked"
        preempted = eng.scheduler.num_preemptions
    return [r.output_token_ids for r in reqs], drafted, kept, preempted


@pytest.mark.parametrize("family", TRANSFORMERS_REFERENCED)
@pytest.mark.parametrize("S", [1, 2])
def test_speculative_tokens_identical(refs, family, S):
    path, ref = refs[family]
    got, drafted, kept, _ = spec_greedy(engine_cfg(path, S=S, budget=64, speculative=SPEC))
    assert got == ref
    assert (drafted, kept) == expected_drafts(PROMPTS, ref, SPEC)
    assert drafted > kept  # some rejected (and, for most families, some kept)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_speculative_under_preemption_chunking_and_prefix_cache(refs, family):
    """16 blocks of 4 slots for four requests: drafts compete for blocks with preempted and
    chunked prefills; two prompts arrive while the others draft, and with the prefix cache on
    only blocks of kept tokens may be registered (a rejected draft's K/V in a registered
    block would hand a later request wrong K/V)."""
    path, ref = refs[family]
    cfg = engine_cfg(path, S=2, blocks=16, budget=8, speculative=SPEC)
    cfg = replace(cfg, cache=replace(cfg.cache, enable_prefix_caching=True))
    got, drafted, kept, preempted = spec_greedy(cfg, arrive_late=2)
    assert preempted > 0 and kept > 0
    assert got == ref
    # the same prompts again: found in the cache, from the blocks the first run registered
    again, *_ = spec_greedy(cfg)
    assert again == ref


def test_sampled_penalized_and_logprob_requests_beside_greedy_ones(refs):
    """One batch: greedy requests (the reference's tokens), seeded sampling ones (drafting,
    the same tokens when run again with the same seed), one asking for logprobs and ones with
    a repetition or frequency penalty and a logit bias: those draft too, each row penalized
    as if the drafts before it were output, and give the tokens (and logprobs) of the same
    engine without drafts; one with bad words may not draft and decodes a token a step."""
    path, ref = refs["qwen3_moe"]
    cfg = engine_cfg(path, S=2, budget=64)
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    # a low temperature: a random model's text drawn hotter rarely repeats, leaving nothing to
    # draft from (the distribution of what is kept: tests/unit/test_spec_decode.py)
    seeded = [
        SamplingParams(max_tokens=NEW, temperature=0.1, top_k=20, seed=s, ignore_eos=True)
        for s in (1, 2)
    ]
    others = [
        replace(greedy, logprobs=2),
        # mild: a strong penalty breaks the loops drafts come from
        replace(greedy, repetition_penalty=1.05),
        replace(greedy, frequency_penalty=0.05, presence_penalty=0.05, logit_bias=((7, 0.5),)),
        replace(greedy, bad_words=((300, 301),)),
    ]

    def one_run(spec):
        most = [0] * 10  # the most tokens each request got in one step
        with local_engine(replace(cfg, speculative=spec), 1, progress=False) as eng:
            reqs = [eng.add_request(p, greedy) for p in PROMPTS]
            reqs += [eng.add_request(PROMPTS[0], sp) for sp in seeded]
            at = (3, 3, 0, 1)
            reqs += [eng.add_request(PROMPTS[i], sp) for i, sp in zip(at, others, strict=True)]
            while eng.has_unfinished():
                before = [len(r.output_token_ids) for r in reqs]
                eng.step()
                for i, r in enumerate(reqs):
                    most[i] = max(most[i], len(r.output_token_ids) - before[i])
        return [r.output_token_ids for r in reqs], reqs, most

    first, reqs, most = one_run(SPEC)
    again, *_ = one_run(SPEC)
    plain, plain_reqs, _ = one_run(None)
    assert first[:4] == ref
    assert first[4:6] == again[4:6] and max(most[4:6]) > 1  # sampled ones kept drafts
    assert first[6:] == plain[6:]
    assert min(most[6:9]) > 1 and most[9] == 1  # logprobs and penalties drafted; bad words not
    got, want = reqs[6].output_logprobs, plain_reqs[6].output_logprobs
    assert len(got) == len(want) == NEW
    for g, w in zip(got, want, strict=True):
        assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-4
        assert [t for t, _ in g.top] == [t for t, _ in w.top]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bf16_drafts_change_no_token_on_each_native_path(refs, family, native_path):
    """bf16 on afd's own kernels (the decode stack where it applies): a verify step computes a
    request's rows as decode rows of a larger batch, and each row's result must not depend on
    the batch it is in, so the tokens with drafts are the tokens without, bit for bit."""
    path, _ = refs[family]
    cfg = replace(engine_cfg(path, dtype="bfloat16", budget=64), decode_stack=True)
    plain, *_ = spec_greedy(cfg)
    got, drafted, kept, _ = spec_greedy(replace(cfg, speculative=SPEC))
    assert drafted > 0
    assert got == plain


def test_a_bursts_tokens_are_not_counted_as_kept_drafts(refs, native_path, monkeypatch):
    """Mixtral's test model runs as one decode stack, so its plain decode steps burst (a burst
    hands its tokens back as kept drafts, runner.py): the drafts counted kept are the verified
    ones only, never more than were drafted, and the tokens are the plain engine's."""
    from services.attention import burst

    bursts = []
    extend = burst.extend

    def spy(*a, **kw):
        plan = extend(*a, **kw)
        bursts.extend(s.burst for s in plan.scheduled if s.burst > 1)
        return plan

    monkeypatch.setattr(burst, "extend", spy)
    path, _ = refs["mixtral"]
    cfg = replace(engine_cfg(path, dtype="bfloat16", budget=64), decode_stack=True)
    plain, *_ = spec_greedy(cfg)
    bursts.clear()
    got, drafted, kept, _ = spec_greedy(replace(cfg, speculative=SPEC))
    assert bursts and drafted > 0, "no burst, or no draft, to tell apart"
    assert 0 <= kept <= drafted
    assert got == plain


def test_random_greedy_requests_draft_to_the_same_tokens(refs):
    """A differential check over many mixed parameter sets (fixed seeds): a batch of greedy
    requests with random max_tokens, min_tokens, stop tokens, penalties, logit biases, bad
    words, allowed tokens and logprobs, on a drafting engine and on the same engine without
    drafts: the same tokens, finish reasons and logprobs, request by request."""
    import random

    path, _ = refs["mixtral"]
    rng = random.Random(7)
    prompts, params = [], []
    for _ in range(12):
        base = [rng.randrange(10, 300) for _ in range(rng.randrange(2, 6))]
        prompts.append(base * rng.randrange(1, 4))
        sp = SamplingParams(
            max_tokens=rng.randrange(1, 30),
            temperature=0,
            ignore_eos=rng.random() < 0.5,
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=tuple(rng.sample(range(10, 300), rng.choice([0, 0, 8]))),
            repetition_penalty=rng.choice([1.0, 1.0, 1.1]),
            frequency_penalty=rng.choice([0.0, 0.0, 0.2]),
            logit_bias=tuple((rng.randrange(300), 1.0) for _ in range(rng.choice([0, 2]))),
            bad_words=((rng.randrange(10, 300),),) if rng.random() < 0.2 else (),
            allowed_token_ids=tuple(range(10, 200)) if rng.random() < 0.15 else (),
            logprobs=rng.choice([None, None, 1]),
        )
        params.append(sp)

    def run(spec):
        drafted = 0
        cfg = replace(engine_cfg(path, S=2, budget=48), speculative=spec)
        with local_engine(cfg, 1, progress=False) as eng:
            reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
            while eng.has_unfinished():
                drafted += eng.step().drafts[1]
            assert eng.blocks.num_free_blocks == eng.blocks.num_blocks, "KV blocks leaked"
        return reqs, drafted

    got, drafted = run(SPEC)
    want, _ = run(None)
    assert drafted > 0
    for g, w in zip(got, want, strict=True):
        assert (g.output_token_ids, g.finish_reason) == (w.output_token_ids, w.finish_reason)
        for a, b in zip(g.output_logprobs, w.output_logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
