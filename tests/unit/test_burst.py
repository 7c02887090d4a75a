"""Bursts (services/attention/burst.py): decode steps in one native call, each fed the tokens
the last one chose (a greedy row's argmax, a sampled row's draw). Against `transformers` on
the same checkpoint, against one step per call, and at the edges: a stop token or max_tokens
inside a burst, logprobs, sampled rows beside greedy ones, a seed, a request whose logits a
penalty changes, a request waiting for a slot, the prefix cache reading K/V a burst wrote.
Mixtral's test model is one stack with the head in the call (bursts run), gpt-oss's has a
sliding window shorter than the contexts here (its experts in bf16, and in MXFP4 as stored)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from afd.control import SamplingParams
from afd_cli.local import local_engine
from services.attention import burst
from services.attention.stack import DecodeStack
from tests.helpers.checkpoints import greedy_gaps, hf_greedy, hf_model

PROMPTS = [[5, 9, 17, 3, 250], list(range(20, 57)), [7, 7, 7]]
# a bf16 token's largest gap below the float32 reference's best logit (test_engine_reference.py)
BF16_GAP = 0.75


def _config(path, steps: int, seqs: int = 8, prefix: bool = False) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig.from_hf(path),
        dtype="bfloat16",
        a2f_dtype="bf16",
        micro_batches=1,
        num_scheduler_steps=steps,
        cache=CacheConfig(block_size=4, num_blocks=256, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=64),
    )


def _run(path, steps: int, prompts, params, seqs: int = 8, monkeypatch=None, prepare=None):
    """(each request's output tokens, the bursts' lengths)."""
    lengths: list[int] = []
    if monkeypatch is not None:
        take = DecodeStack.take_burst
        monkeypatch.setattr(DecodeStack, "take_burst", lambda self: _seen(take(self), lengths))
    with local_engine(_config(path, steps, seqs), 1, progress=False) as eng:
        if prepare is not None:
            prepare(eng)
        reqs = eng.generate(prompts, params)
    return [r.output_token_ids for r in reqs], lengths


@pytest.fixture(autouse=True)
def _any_step_time(monkeypatch):
    """A burst's length here is the cap, however long this machine's steps take."""
    monkeypatch.setattr(burst, "BUDGET_S", 3600.0)


@pytest.mark.parametrize("ckpt", ["mixtral_dir", "gpt_oss_dir"])
def test_bursts_give_one_steps_tokens_and_transformers_greedy(
    native_path, ckpt, request, monkeypatch
):
    """The same tokens as one step a call (the same kernels: the same bits), and each one
    transformers' float32 argmax or within bf16's near-tie tolerance of it, teacher-forced."""
    path = request.getfixturevalue(ckpt)
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    tokens, lengths = _run(path, 4, PROMPTS, sp, monkeypatch=monkeypatch)
    assert lengths and max(lengths) == 4, "no burst ran"
    assert tokens == _run(path, 1, PROMPTS, sp)[0]
    ref = hf_model(path, torch.float32)
    gap, agree = _gaps(ref, tokens)
    hf_gap, hf_agree = _gaps(ref, hf_greedy(hf_model(path, torch.bfloat16), PROMPTS, 14))
    assert gap <= max(BF16_GAP, hf_gap), f"a token {gap:.3f} below the reference's best"
    assert agree >= min(0.9, hf_agree - 0.05), f"at the reference's argmax {agree:.0%}"


def test_a_sparse_attention_burst_gives_one_steps_tokens(native_path, dsa_dir, monkeypatch):
    """DeepSeek-V3.2: each step of a burst writes its indexer keys before the next selects
    from them (the fused layer's call, indexer.c), as one step a call does."""
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    tokens, lengths = _run(dsa_dir, 4, PROMPTS, sp, monkeypatch=monkeypatch)
    assert lengths and max(lengths) == 4, "no burst ran"
    assert tokens == _run(dsa_dir, 1, PROMPTS, sp)[0]


def test_bursts_give_one_steps_tokens_with_mxfp4_experts(
    native_path, gpt_oss_mxfp4_dir, monkeypatch
):
    """The MXFP4 experts multiplied as stored, in the call (their reference tests compare the
    one-step path with transformers: test_mxfp4.py)."""
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    tokens, lengths = _run(gpt_oss_mxfp4_dir, 4, PROMPTS, sp, monkeypatch=monkeypatch)
    assert lengths and max(lengths) == 4, "no burst ran"
    assert tokens == _run(gpt_oss_mxfp4_dir, 1, PROMPTS, sp)[0]


def _gaps(ref, got: list[list[int]]) -> tuple[float, float]:
    """(the worst gap below the reference's best logit, the share of tokens at its argmax)."""
    gaps = [g for p, t in zip(PROMPTS, got, strict=True) for g in greedy_gaps(ref, p, t)]
    return max(gaps), sum(g == 0.0 for g in gaps) / len(gaps)


def test_a_stop_or_the_length_inside_a_burst_ends_the_request_there(
    native_path, mixtral_dir, monkeypatch
):
    free = SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)
    want, _ = _run(mixtral_dir, 1, PROMPTS[:1], free)
    stop = want[0][6]  # the 7th token: inside the second burst of 4 (after a first step)
    first = want[0].index(stop)
    sp = SamplingParams(max_tokens=13, temperature=0, stop_token_ids=(stop,), ignore_eos=True)
    (got,), lengths = _run(mixtral_dir, 4, PROMPTS[:1], sp, monkeypatch=monkeypatch)
    assert lengths, "no burst ran"
    assert got == want[0][: first + 1]
    # 13 tokens: the prefill's, one measured step's, bursts of 4, 4, then of the 3 left
    (got,), lengths = _run(mixtral_dir, 4, PROMPTS[:1], free, monkeypatch=monkeypatch)
    assert got == want[0] and len(got) == 13


def test_a_bursts_logprobs_are_one_steps(native_path, mixtral_dir, monkeypatch):
    """Logprobs (the chosen token's and the top 3) read from each step's logits after the call:
    the same numbers as one step a call reports."""
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)

    def run(steps, mp=None):
        lengths: list[int] = []
        if mp is not None:
            take = DecodeStack.take_burst
            mp.setattr(DecodeStack, "take_burst", lambda s: _seen(take(s), lengths))
        with local_engine(_config(mixtral_dir, steps), 1, progress=False) as eng:
            reqs = eng.generate(PROMPTS[:2], [scored, greedy])
        return [(r.output_token_ids, r.output_logprobs) for r in reqs], lengths

    got, lengths = run(4, monkeypatch)
    want, _ = run(1)
    assert lengths, "no burst ran"
    assert got[0][0] == want[0][0] and got[1][0] == want[1][0]
    assert got[0][1] == want[0][1] and len(got[0][1]) == 10  # each token's, the same bits
    assert all(len(lp.top) == 3 for lp in got[0][1]) and got[1][1] == []


def test_sampled_rows_burst_and_draw_from_their_own_steps_logits(
    native_path, mixtral_dir, monkeypatch
):
    """Beside a greedy row, a sampled row with top_k 1 (the draw can only be its step's
    argmax) decodes the greedy tokens, so each draw in the call read its own step's logits;
    a row at temperature 1.2 with top_k 3 draws each token from its step's top 3."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    top1 = SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True)
    top3 = SamplingParams(max_tokens=12, temperature=1.2, top_k=3, ignore_eos=True, logprobs=3)
    want, _ = _run(mixtral_dir, 1, PROMPTS[:2], greedy)
    torch.manual_seed(0)
    lengths: list[int] = []
    take = DecodeStack.take_burst
    monkeypatch.setattr(DecodeStack, "take_burst", lambda self: _seen(take(self), lengths))
    with local_engine(_config(mixtral_dir, 4), 1, progress=False) as eng:
        reqs = eng.generate(PROMPTS, [greedy, top1, top3])
    assert lengths and max(lengths) == 4, "no burst ran"
    assert [r.output_token_ids for r in reqs[:2]] == [want[0], want[1]]
    drawn = reqs[2]
    assert len(drawn.output_token_ids) == 12
    for token, lp in zip(drawn.output_token_ids, drawn.output_logprobs, strict=True):
        assert token in [t for t, _ in lp.top], "a draw outside its step's top 3"


def test_a_seed_keeps_a_request_out_of_bursts(native_path, mixtral_dir, monkeypatch):
    """A seeded request's tokens are the same run after run: it steps one at a time and draws
    from its own generator, as without bursts (so does every sampled request where the engine's
    generator is seeded: --sampling-seed)."""
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    want, _ = _run(mixtral_dir, 1, PROMPTS[:1], seeded)
    got, lengths = _run(mixtral_dir, 4, PROMPTS[:1], seeded, monkeypatch=monkeypatch)
    assert got == want and not lengths, "a seeded request burst"
    free = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    lengths.clear()
    cfg = dataclasses.replace(_config(mixtral_dir, 4), sampling_seed=11)
    with local_engine(cfg, 1, progress=False) as eng:
        eng.generate(PROMPTS[:1], free)
    assert not lengths, "a sampled request burst under a seeded generator"


def _seen(found, lengths: list[int]):
    if found is not None:
        lengths.append(found[0].shape[0])
    return found


def test_no_burst_beside_a_penalty_or_while_a_request_waits(native_path, mixtral_dir, monkeypatch):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=1)
    want, _ = _run(mixtral_dir, 1, PROMPTS[:2], [greedy, penalized])
    got, lengths = _run(mixtral_dir, 4, PROMPTS[:2], [greedy, penalized], monkeypatch=monkeypatch)
    assert got == want and not lengths, "a burst ran beside a request with a penalty"
    # one slot, two requests: the first runs without bursts while the second waits, then the
    # second bursts alone
    want, _ = _run(mixtral_dir, 1, PROMPTS[:2], greedy, seqs=1)
    got, lengths = _run(mixtral_dir, 4, PROMPTS[:2], greedy, seqs=1, monkeypatch=monkeypatch)
    assert got == want
    assert 0 < len(lengths) <= 3, "bursts ran while a request waited"


def test_the_prefix_cache_reads_what_a_burst_wrote(native_path, mixtral_dir):
    """A second prompt that continues the first's prompt and output starts from the cached
    blocks the first's bursts filled; its tokens are those of a cold run."""
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with local_engine(_config(mixtral_dir, 4, prefix=True), 1, progress=False) as eng:
        (first,) = eng.generate(PROMPTS[1:2], sp)
        follow = PROMPTS[1] + first.output_token_ids[:10]
        (second,) = eng.generate([follow], sp)
        assert second.num_cached_tokens >= 40, "the burst's blocks were not cached"
    assert second.output_token_ids == _run(mixtral_dir, 1, [follow], sp)[0][0]


@pytest.mark.parametrize("tied", [0, 1])
def test_a_tied_layer_in_a_burst_routes_as_in_one_step(
    native_path, tie_routing, mixtral_dir, tied, monkeypatch
):
    """Every router logit of one layer ties: where topk.c breaks the tie the bursts run whole;
    where it leaves the layer to torch, each call ends at that layer of its first step and the
    step goes on one at a time. The tokens are those of one step a call either way."""
    from afd.kernels import gemm

    def prepare(eng):
        r = eng.model.layers[tied].router
        same = torch.randn(1, r.w.shape[1]).to(torch.bfloat16).expand(r.w.shape[0], -1)
        r.w.copy_(gemm.lay_out(same, r.isa))

    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    torch.manual_seed(0)
    want, _ = _run(mixtral_dir, 1, PROMPTS, sp, prepare=prepare)
    torch.manual_seed(0)
    got, lengths = _run(mixtral_dir, 4, PROMPTS, sp, monkeypatch=monkeypatch, prepare=prepare)
    assert got == want
    assert bool(lengths) == tie_routing, "bursts ran past a layer left to torch (or not at all)"


def test_a_bursts_length_fits_its_budget(monkeypatch):
    monkeypatch.setattr(burst, "BUDGET_S", 0.025)
    p = burst.Policy(cap=4)
    assert p.steps() == 1, "the first decode step is measured, not guessed"
    p.observe(0.002, 1)
    assert p.steps() == 4
    for _ in range(30):
        p.observe(0.040, 4)  # 10 ms a step: two fit 25 ms
    assert p.steps() == 2
    for _ in range(30):
        p.observe(0.030, 1)
    assert p.steps() == 1
    assert burst.Policy(cap=1).steps() == 1
