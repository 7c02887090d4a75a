"""Speculative decoding's pieces without a model: the n-gram drafter, its config and flag, and
the scheduler driven by a fake greedy model that reads every token back through the block
table (a draft's K/V in the wrong slot, a kept draft not counted or a rejected one counted,
changes the output)."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from afd import flags as afd_flags
from afd.config import SchedulerConfig, SpeculativeConfig
from afd.control import SamplingParams
from afd.errors import ConfigError
from services.attention import flags as attention_flags
from services.attention.block_manager import BlockManager
from services.attention.request import Request
from services.attention.sampler import verify_drafts, verify_sampled_drafts
from services.attention.scheduler import Scheduler, SchedulerOutput
from services.attention.speculative import NgramDrafter, room, speculable

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


def request(prompt, out=(), max_tokens=50, **sp) -> Request:
    sp = {"temperature": 0} | sp
    r = Request("r", list(prompt), SamplingParams(max_tokens=max_tokens, **sp))
    r.output_token_ids = list(out)
    return r


# ---- the drafter ---------------------------------------------------------------------------


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    d = NgramDrafter(SPEC)
    # "1 2 3" occurred twice; the later one was followed by 7 8 9
    assert d.propose(request([1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3]), 3) == [7, 8, 9]
    # the 3-gram "5 2 3" never occurred: "2 3" (n = 2) did, last followed by 9
    d = NgramDrafter(SPEC)
    assert d.propose(request([1, 2, 3, 9, 4, 5, 2, 3]), 3) == [9, 4, 5]


def test_a_loop_shorter_than_k_repeats_into_the_drafts():
    d = NgramDrafter(SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1))
    assert d.propose(request([4, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]


def test_no_drafts_without_an_earlier_occurrence_or_room():
    d = NgramDrafter(SPEC)
    assert d.propose(request([1, 2, 3, 4]), 3) == []
    assert d.propose(request([1, 2, 1, 2]), 0) == []
    assert d.propose(request([1, 2, 1, 2]), 1) == [1]  # the limit caps k


def test_the_index_grows_with_the_output():
    d = NgramDrafter(SPEC)
    r = request([5, 6, 7, 8])
    assert d.propose(r, 3) == []
    r.output_token_ids = [9, 5, 6]  # now "5 6" occurred before, followed by 7 8 9
    assert d.propose(r, 3) == [7, 8, 9]
    d.release("r")
    assert d._index == {}


def test_a_long_text_is_indexed_a_slice_a_step_newest_first():
    """A prompt longer than a step's backlog: the newest part is searched at once, the older
    a slice per proposal, and a later occurrence is never replaced by an earlier one."""
    from services.attention.speculative import BACKLOG_PER_STEP

    filler = [1000 + i for i in range(3 * BACKLOG_PER_STEP)]  # no n-gram repeats in it
    early = [7, 8, 9, 70, 71, 72]  # "7 8 9" first followed by 70 ..
    late = [7, 8, 9, 80, 81, 82]  # .. then, within the newest slice, by 80
    r = request(early + filler + late + filler[:10] + [7, 8, 9])
    d = NgramDrafter(SPEC)
    assert d.propose(r, 3) == [80, 81, 82]
    r2 = request(early + filler + [7, 8, 9])  # only the early one, three slices back
    d2 = NgramDrafter(SPEC)
    got = [d2.propose(r2, 3) for _ in range(4)]
    assert got[0] == [] and got[-1] == [70, 71, 72]
    for _ in range(4):  # the backlog reaches the early one: the late one stays the answer
        assert d.propose(r, 3) == [80, 81, 82]


@pytest.mark.parametrize(
    "sampling",
    [
        {"guide_kind": "regex", "guide": "a+", "guide_after": (9,)},
        {"bad_words": ((3,),)},
        {"allowed_token_ids": (1, 2)},
        {"min_tokens": 5},
    ],
)
def test_requests_whose_rows_cannot_be_verified_alone_do_not_draft(sampling):
    sp = {"temperature": 0} | sampling
    r = Request("r", [1, 2, 1, 2], SamplingParams(max_tokens=50, **sp))
    assert not speculable(r)
    assert NgramDrafter(SPEC).propose(r, 3) == []
    assert speculable(request([1, 2, 1, 2]))
    assert speculable(request([1, 2, 1, 2], temperature=0.7, top_k=5, top_p=0.9, seed=3))
    assert speculable(request([1, 2], logprobs=2, repetition_penalty=1.2, logit_bias=((3, 1.0),)))


def test_room_keeps_the_drafts_and_the_next_token_within_max_tokens_and_the_context():
    r = request([1] * 10, out=[2] * 5, max_tokens=8)
    assert room(r, 100) == 2  # 3 tokens left: 2 drafts and the token after them
    assert room(r, 17) == 1  # 2 positions left in the context


def test_config_validates_and_names_unknown_keys():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    only_max = SpeculativeConfig.from_dict({"prompt_lookup_max": 1})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (1, 1)
    for bad, words in [
        ({"method": "eagle"}, "method"),
        ({"model": "some/draft"}, "unknown speculative-config key(s) ['model']"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": "4"}, "must be int"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "1 <= min <= max"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            SpeculativeConfig.from_dict(bad)


def test_the_flag_fills_the_engine_config_and_is_passed_on(qwen3_dir):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(qwen3_dir))
    actions = attention_flags.add_engine_flags(p)
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = p.parse_args(["--speculative-config", text])
    cfg = attention_flags.engine_config(args)
    assert cfg.speculative == SpeculativeConfig(num_speculative_tokens=2)
    argv = afd_flags.forward(args, actions)
    i = argv.index("--speculative-config")
    assert p.parse_args(argv[i : i + 2]).speculative == args.speculative
    assert attention_flags.engine_config(p.parse_args([])).speculative is None


def test_verify_keeps_drafts_while_each_is_the_argmax_of_the_row_before():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 2, 8]):
        logits[row, best] = 1.0
    assert verify_drafts(logits, (3, 5, 7)) == ([3, 5], 2)
    assert verify_drafts(logits, (3, 5, 2)) == ([3, 5, 2], 8)  # all kept: the 4th row's token
    assert verify_drafts(logits, (4, 5, 2)) == ([], 3)


def test_sampled_drafts_give_each_token_the_distribution_of_a_step_by_step_draw():
    """Two drafts over a 5-token vocabulary, drawn 40000 times (seeded): the first token is
    distributed as row 0 says, the second (where the first draft was kept) as row 1 says,
    and the token after both drafts as row 2, with temperature and top-k applied."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5) * 1.5
    sp = SamplingParams(temperature=0.8, top_k=4, max_tokens=10)
    drafts = (int(logits[0].argmax()), int(logits[1].argsort()[-2]))  # likely, then middling
    x = logits / 0.8
    x[x < x.topk(4, dim=-1).values[:, -1:]] = float("-inf")
    want = torch.softmax(x, dim=-1)  # [3, 5]
    gen = torch.Generator().manual_seed(1)
    N = 40_000
    first, second, third = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    n_second = n_third = 0
    for _ in range(N):
        kept, token = verify_sampled_drafts(logits, drafts, sp, gen)
        out = kept + [token]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            n_second += 1
        if len(out) > 2:
            third[out[2]] += 1
            n_third += 1
    assert n_second > 1000 and n_third > 1000
    for got, n, row in ((first, N, 0), (second, n_second, 1), (third, n_third, 2)):
        p = want[row]
        sigma = (p * (1 - p) / n).sqrt()
        assert ((got / n - p).abs() <= 5 * sigma + 1e-9).all(), (row, got / n, p)
    assert first[int(logits[0].argmin())] == 0  # outside the top-k: never, drafted or not


# ---- the scheduler with a fake greedy model --------------------------------------------------


class FakeGreedy:
    """Writes each scheduled token into a simulated paged cache; a position's greedy token is a
    function of the two tokens before it read back through the block table, over a few values,
    so outputs fall into loops that n-gram drafts catch."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.kv: dict[tuple[int, int], int] = {}

    def _slot(self, blocks, pos):
        return blocks[pos // self.bs], pos % self.bs

    def step(self, out: SchedulerOutput):
        for s in out.scheduled:
            for j, tok in enumerate(s.token_ids):
                self.kv[self._slot(s.block_ids, s.start_pos + j)] = tok
        sampled, kept = {}, {}
        for s in out.scheduled:
            if not s.sample:
                continue
            end = s.start_pos + s.num_new_tokens
            seq = [self.kv[self._slot(s.block_ids, p)] for p in range(end)]
            first = end - 1 - len(s.draft_ids)  # the row of the request's last real token
            best = [10 + (seq[p - 1] * 3 + seq[p]) % 5 for p in range(first, end)]
            n = 0
            while n < len(s.draft_ids) and best[n] == s.draft_ids[n]:
                n += 1
            if s.draft_ids:
                kept[s.request.request_id] = [(t, None) for t in s.draft_ids[:n]]
            sampled[s.request.request_id] = best[n]
        return sampled, kept


def run(sched: Scheduler, prompts, max_tokens=30, stop_token_ids=()):
    model = FakeGreedy(sched.block_manager.block_size)
    reqs = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, stop_token_ids=stop_token_ids)
        reqs.append(Request(f"r{i}", list(p), sp))
        sched.add_request(reqs[-1])
    drafted = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        drafted += sum(len(s.draft_ids) for s in out.scheduled)
        sampled, kept = model.step(out)
        sched.update(out, sampled, kept=kept)
        for x in out.scheduled:  # a sampled request's K/V is all but its last token's, no more
            r = x.request
            if x.sample and not r.finished and r.status.value == "running":
                assert r.num_computed_tokens == r.num_tokens - 1
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return [r.output_token_ids for r in reqs], drafted


PROMPTS = [[11, 12, 13, 11, 12], [14, 10, 12], [13, 13, 13, 13, 10, 11], [12, 14]]


def sched(drafter=True, blocks=64, budget=64, off=0, caching=False):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64)
    spec = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=off
    )
    d = NgramDrafter(spec) if drafter else None
    return Scheduler(cfg, BlockManager(blocks, 4), 64, caching, d)


@pytest.mark.parametrize(
    "blocks,budget,caching",
    [(64, 64, False), (12, 64, False), (64, 6, False), (12, 7, True)],
    ids=["roomy", "preempting", "chunked", "all-at-once"],
)
@pytest.mark.timeout(30)
def test_drafted_runs_give_the_plain_runs_tokens(blocks, budget, caching):
    want, none = run(sched(False, blocks, budget, caching=caching), PROMPTS)
    got, drafted = run(sched(True, blocks, budget, caching=caching), PROMPTS)
    assert none == 0 and drafted > 0
    assert got == want


def test_a_stop_token_among_the_kept_drafts_ends_the_request_there():
    want, _ = run(sched(False), PROMPTS, stop_token_ids=(12,))
    got, drafted = run(sched(True), PROMPTS, stop_token_ids=(12,))
    assert drafted > 0 and got == want
    assert all(out[-1] == 12 and 12 not in out[:-1] for out in got if 12 in out)


def test_max_tokens_is_never_passed():
    got, drafted = run(sched(True), PROMPTS, max_tokens=7)
    assert drafted > 0 and all(len(out) == 7 for out in got)


def test_no_drafts_above_the_batch_size_that_turns_them_off():
    _, drafted = run(sched(True, off=3), PROMPTS[:3])
    assert drafted > 0
    s = sched(True, off=3)
    for i, p in enumerate(PROMPTS):  # four running: none drafts
        s.add_request(Request(f"r{i}", list(p), SamplingParams(max_tokens=30, temperature=0)))
    model = FakeGreedy(4)
    for _ in range(5):
        out = s.schedule()
        assert not any(x.draft_ids for x in out.scheduled)
        s.update(out, *model.step(out)[:1])


# ---- a speculating seq's rows settled (runner._settle) ---------------------------------------


def _settle(sp, rows, drafts, out_ids=(), guides=None):
    """ModelRunner._settle on one seq, without a model (it needs only these helpers)."""
    from types import SimpleNamespace

    from services.attention.runner import Executed, ModelRunner
    from services.attention.scheduler import ScheduledSeq

    req = Request("r", [1, 2], sp)
    req.output_token_ids = list(out_ids)
    seq = ScheduledSeq(req, [req.all_token_ids[-1], *drafts], 2, [0], True, drafts)
    me = SimpleNamespace(
        _prompt_ids=lambda r: torch.tensor(r.prompt_token_ids),
        _generator=lambda rid, seed: None,
        guides=guides,
    )
    out = Executed()
    ModelRunner._settle(me, seq, rows, out)
    return out


def test_each_row_is_penalized_as_if_the_drafts_before_it_were_output():
    """Row 1 follows draft 3: a frequency penalty of 0.5 counts that 3 (and the output's), so
    3's lead of 0.6 there turns into 5's; without the draft in its history 3 would stay."""
    rows = torch.zeros(3, 8)
    rows[0, 3] = 2.0
    rows[1, 3], rows[1, 5] = 1.6, 1.0
    rows[2, 4] = 1.0
    sp = SamplingParams(max_tokens=9, temperature=0, frequency_penalty=0.5, logprobs=1)
    out = _settle(sp, rows.clone(), (3, 3), out_ids=[3])
    assert [t for t, _ in out.kept["r"]] == [3] and out.sampled["r"] == 5
    # logprobs: of the model's own rows, before the penalty
    (lp3,) = [lp for _, lp in out.kept["r"]]
    own = torch.log_softmax(rows, dim=-1)
    assert lp3.token_id == 3 and abs(lp3.logprob - float(own[0, 3])) < 1e-6
    assert abs(out.logprobs["r"].logprob - float(own[1, 5])) < 1e-6
    assert out.logprobs["r"].top[0][0] == 3  # the model's own best at row 1, penalty or not


def test_a_grammar_completed_by_a_kept_draft_ends_the_output_there():
    """Three drafts all kept, but the grammar is complete after the second: the output ends
    with it (the rest of the drafts and the token after them are dropped) and is "ended"."""
    from types import SimpleNamespace

    taken: list[int] = []
    guides = SimpleNamespace(
        mask_drafted_=lambda rows, rid, drafts: None,
        accept=lambda rid, t: taken.append(t) or len(taken) == 2,
    )
    rows = torch.zeros(4, 8)
    for i, best in enumerate([3, 4, 5, 6]):
        rows[i, best] = 1.0
    sp = SamplingParams(max_tokens=9, temperature=0, guide_kind="regex", guide="x")
    out = _settle(sp, rows, (3, 4, 5), guides=guides)
    assert [t for t, _ in out.kept["r"]] == [3] and out.sampled["r"] == 4
    assert out.ended == {"r"} and taken == [3, 4]


def test_a_kept_draft_that_is_a_stop_token_ends_the_request_at_it():
    """A prompt holding a whole period of the fake model's own loop: every draft is kept, and
    the stop token comes as the second draft of a step, not as the token after the drafts."""

    def chain(a, b, n):
        out = [a, b]
        while len(out) < n:
            out.append(10 + (out[-2] * 3 + out[-1]) % 5)
        return out

    text = chain(11, 12, 60)
    prompt, rest = text[:40], text[40:]
    stop = next(t for i, t in enumerate(rest) if i >= 2 and t not in rest[:i])
    at = rest.index(stop)
    s = sched(True)
    sp = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop,))
    r = Request("r", prompt, sp)
    s.add_request(r)
    model = FakeGreedy(4)
    kept_stop = False
    while s.has_unfinished():
        out = s.schedule()
        sampled, kept = model.step(out)
        kept_stop |= any(t == stop for k in kept.values() for t, _ in k)
        s.update(out, sampled, kept=kept)
    assert kept_stop  # the case this test is for
    assert r.output_token_ids == rest[: at + 1] and r.finish_reason == "stop"
