"""Scheduler driven by fabricated runner outputs (no torch, no model).

`FakeModel` stands in for the runner: it writes every scheduled token into a simulated paged KV
cache through the seq's block table and, when asked to sample, reads the whole sequence back
through that table. The next token is a pure function of the sequence read, so a wrong block
table, a block shared by two live requests or a missed token changes the output — comparing a
constrained run with an unconstrained one checks the bookkeeping end to end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from afd.config import SchedulerConfig
from afd.control import Logprob, SamplingParams
from afd.errors import ConfigError, RequestError
from services.attention.block_manager import BlockManager
from services.attention.request import Request, RequestStatus
from services.attention.scheduler import Scheduler, SchedulerOutput

REPO = Path(__file__).resolve().parents[2]


def next_token(seq: list[int]) -> int:
    h = len(seq)
    for t in seq:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return 10 + h % 990  # never 0..9, which the tests use as eos / stop ids


class FakeModel:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        for s in out.scheduled:  # write all K/V first, as a batched forward would
            assert (
                s.token_ids == s.request.all_token_ids[s.start_pos : s.start_pos + len(s.token_ids)]
            )
            for j, tok in enumerate(s.token_ids):
                self.kv[self._slot(s.block_ids, s.start_pos + j)] = tok
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                end = s.start_pos + s.num_new_tokens
                seq = [self.kv[self._slot(s.block_ids, p)] for p in range(end)]
                sampled[s.request.request_id] = next_token(seq)
        return sampled


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 64,
    chunked: bool = True,
) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, chunked)
    return Scheduler(cfg, BlockManager(num_blocks, block_size), max_model_len)


def req(rid: str, n_prompt: int, max_tokens: int = 4, **sp: object) -> Request:
    prompt = [(7 * len(rid) + 3 * i + ord(rid[-1])) % 50 + 10 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), eos_token_ids=(2,))


def check_invariants(s: Scheduler, out: SchedulerOutput) -> None:
    cfg = s.config
    assert out.num_batched_tokens == sum(x.num_new_tokens for x in out.scheduled)
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and s.num_running <= cfg.max_num_seqs
    ids = [x.request.request_id for x in out.scheduled]
    assert len(ids) == len(set(ids)) and not set(ids) & set(out.preempted)
    bm = s.block_manager
    for x in out.scheduled:
        assert len(x.block_ids) >= bm.blocks_needed(x.start_pos + x.num_new_tokens)
        assert x.sample == (x.start_pos + x.num_new_tokens == x.request.num_tokens)
    held = [b for r in s._running for b in r.block_ids]
    assert len(held) == len(set(held)) == bm.num_used_blocks  # disjoint, nothing leaked


def run(s: Scheduler, model: FakeModel | None = None, max_steps: int = 10_000) -> list[Request]:
    """Step until every request is done; returns requests in the order they finished."""
    model = model or FakeModel(s.block_manager.block_size)
    finished: list[Request] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
            return finished
        out = s.schedule()
        check_invariants(s, out)
        finished += [r for r in s.update(out, model.step(out)) if r.finished]
    raise AssertionError("scheduler made no progress")


def outputs(reqs: list[Request]) -> dict[str, list[int]]:
    return {r.request_id: r.output_token_ids for r in reqs}


def test_prefill_then_decode() -> None:
    s = make(block_size=4)
    r = req("a", 5, max_tokens=3)
    s.add_request(r)
    model = FakeModel(4)
    out = s.schedule()
    [seq] = out.scheduled
    assert (seq.start_pos, seq.num_new_tokens, seq.sample, seq.block_ids) == (0, 5, True, [0, 1])
    assert r.status is RequestStatus.RUNNING and r.first_scheduled_time is not None
    t0 = r.first_scheduled_time
    assert s.update(out, model.step(out)) == [r]
    assert r.num_computed_tokens == 5 and len(r.output_token_ids) == 1
    for pos in (5, 6):
        out = s.schedule()
        [seq] = out.scheduled
        assert (seq.start_pos, seq.token_ids) == (pos, [r.all_token_ids[pos]])
        assert seq.block_ids == [0, 1] and out.num_batched_tokens == 1
        assert s.update(out, model.step(out)) == [r]
    assert r.finished and r.finish_reason == "length" and len(r.output_token_ids) == 3
    assert r.first_scheduled_time == t0
    assert r.block_ids == [] and s.block_manager.num_free_blocks == 64
    assert not s.has_unfinished() and not s.abort("a")  # unknown by now


def test_decode_takes_a_new_block_at_the_boundary() -> None:
    s = make(block_size=4)
    r = req("a", 4, max_tokens=3)
    s.add_request(r)
    model = FakeModel(4)
    tables = []
    while s.has_unfinished():
        out = s.schedule()
        tables.append(out.scheduled[0].block_ids)
        s.update(out, model.step(out))
    assert tables == [[0], [0, 1], [0, 1]]  # position 4 is the first slot of a second block


def test_chunked_prefill_splits_and_samples_only_on_last_chunk() -> None:
    s = make(budget=4, max_num_seqs=4)
    r = req("a", 10, max_tokens=2)
    s.add_request(r)
    model = FakeModel(4)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        [seq] = out.scheduled
        chunks.append((seq.start_pos, seq.num_new_tokens, seq.sample))
        got = s.update(out, model.step(out))
        assert got == ([r] if seq.sample else [])
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert len(r.output_token_ids) == 1 and r.num_computed_tokens == 10
    run(s, model)
    ref = make()
    ref.add_request(req("a", 10, max_tokens=2))
    assert r.output_token_ids == run(ref)[0].output_token_ids


def test_running_decodes_come_first_and_prefill_gets_the_rest_of_the_budget() -> None:
    s = make(budget=6)
    a, b = req("a", 3, max_tokens=8), req("b", 10, max_tokens=2)
    s.add_request(a)
    model = FakeModel(4)
    out = s.schedule()
    s.update(out, model.step(out))
    s.add_request(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 5)]
    assert out.num_batched_tokens == 6
    s.update(out, model.step(out))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 5)]
    assert out.scheduled[1].sample
    run(s, model)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    s = make(budget=8, max_model_len=8, chunked=False)
    a, b = req("a", 5, max_tokens=2), req("b", 5, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    model = FakeModel(4)
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    s.update(out, model.step(out))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 5)]
    s.update(out, model.step(out))
    run(s, model)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make(budget=4, max_model_len=8, chunked=False)


def test_max_num_seqs_is_respected_and_admission_is_fcfs() -> None:
    s = make(max_num_seqs=2)
    reqs = [req(f"r{i}", 3, max_tokens=3) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    finished = run(s)
    assert [r.request_id for r in finished] == [r.request_id for r in reqs]
    times = [r.first_scheduled_time for r in reqs]
    assert times == sorted(times)


def test_preempts_the_latest_admitted_when_blocks_run_out() -> None:
    # 4 blocks of 2 tokens: after one decode each, b (the tail) needs a 3rd block and none is free
    s = make(num_blocks=4, block_size=2)
    a, b = req("a", 3, max_tokens=5), req("b", 4, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    model = FakeModel(2)
    out = s.schedule()
    assert [x.block_ids for x in out.scheduled] == [[0, 1], [2, 3]]
    s.update(out, model.step(out))
    out = s.schedule()
    assert out.preempted == ["b"] and [x.request for x in out.scheduled] == [a]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and s.num_preemptions == 1 and len(b.output_token_ids) == 1
    assert s.num_waiting == 1 and s.block_manager.num_free_blocks == 2
    s.update(out, model.step(out))
    run(s, model)
    assert len(a.output_token_ids) == 5 and len(b.output_token_ids) == 4
    ref = make()
    ref.add_request(req("a", 3, max_tokens=5))
    ref.add_request(req("b", 4, max_tokens=4))
    assert outputs(run(ref)) == outputs([a, b])


def test_running_request_preempts_others_from_the_tail_until_it_fits() -> None:
    s = make(num_blocks=6, block_size=2, max_model_len=12)
    a, b, c = req("a", 4, max_tokens=7), req("b", 2, max_tokens=2), req("c", 2, max_tokens=2)
    for r in (a, b, c):
        s.add_request(r)
    model = FakeModel(2)
    out = s.schedule()  # a: 2 blocks, b: 1, c: 1 -> 2 free
    s.update(out, model.step(out))
    out = s.schedule()  # a needs a 3rd block (5 tokens), b and c a 2nd (3 tokens): c is preempted
    assert out.preempted == ["c"]
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s._waiting] == ["c"]
    s.update(out, model.step(out))
    run(s, model)
    assert [len(r.output_token_ids) for r in (a, b, c)] == [7, 2, 2]


def test_preemption_under_pressure_gives_the_unconstrained_outputs() -> None:
    def workload() -> list[Request]:
        return [req(f"r{i}", 3 + (5 * i) % 11, max_tokens=4 + (3 * i) % 9) for i in range(12)]

    ref = make(num_blocks=256, budget=512, max_num_seqs=16, max_model_len=32)
    for r in workload():
        ref.add_request(r)
    expected = outputs(run(ref))
    assert ref.num_preemptions == 0

    s = make(num_blocks=10, block_size=4, budget=16, max_num_seqs=6, max_model_len=32)
    reqs = workload()
    for r in reqs:
        s.add_request(r)
    got = run(s)
    assert s.num_preemptions > 0
    assert outputs(got) == expected
    assert all(len(r.output_token_ids) == r.sampling.max_tokens for r in reqs)
    assert all(r.finish_reason == "length" for r in reqs)
    times = [r.first_scheduled_time for r in reqs]
    assert times == sorted(times)  # FCFS admission: nobody behind jumps ahead


def test_fcfs_head_that_does_not_fit_blocks_smaller_requests_behind_it() -> None:
    s = make(num_blocks=4, block_size=4, max_model_len=32)
    a, big, small = req("a", 8, max_tokens=4), req("big", 12, max_tokens=2), req("s", 2, 1)
    for r in (a, big, small):
        s.add_request(r)
    out = s.schedule()  # a takes 2 blocks; big needs 3 of the 2 left; small would fit but waits
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert s.num_waiting == 2
    model = FakeModel(4)
    while not a.finished:
        s.update(out, model.step(out))
        assert small.first_scheduled_time is None  # never jumps the queue while a holds blocks
        out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["big", "s"]
    s.update(out, model.step(out))
    run(s, model)
    assert big.finished and small.finished


def test_equal_requests_under_pressure_finish_in_arrival_order() -> None:
    s = make(num_blocks=6, block_size=2, budget=8, max_num_seqs=4, max_model_len=16)
    reqs = [req(f"r{i:02d}", 3, max_tokens=6) for i in range(10)]
    for r in reqs:
        s.add_request(r)
    finished = run(s)
    assert s.num_preemptions > 0
    assert [r.request_id for r in finished] == [r.request_id for r in reqs]


def test_abort_waiting_and_running_frees_blocks_at_once() -> None:
    s = make(num_blocks=8, block_size=4, max_num_seqs=1)
    a, b = req("a", 9, max_tokens=8), req("b", 3)
    s.add_request(a)
    s.add_request(b)
    model = FakeModel(4)
    out = s.schedule()
    s.update(out, model.step(out))
    assert s.block_manager.num_used_blocks == 3
    assert s.abort("b") and b.finish_reason == "abort" and b.finished and s.num_waiting == 0
    assert s.abort("a") and a.finish_reason == "abort" and s.num_running == 0
    assert s.block_manager.num_free_blocks == 8 and a.block_ids == []
    assert not s.abort("a") and not s.abort("nope")
    assert not s.has_unfinished()


def test_abort_between_schedule_and_update_is_skipped() -> None:
    s = make()
    a, b = req("a", 3, max_tokens=2), req("b", 3, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    model = FakeModel(4)
    out = s.schedule()
    sampled = model.step(out)
    assert s.abort("a")
    assert s.update(out, sampled) == [b]
    assert a.output_token_ids == [] and a.finish_reason == "abort"
    run(s, model)
    assert len(b.output_token_ids) == 2


def test_prompt_too_long_names_both_numbers() -> None:
    s = make(max_model_len=16)
    with pytest.raises(RequestError, match=r"prompt has 16 tokens; the context is 16 tokens"):
        s.add_request(req("a", 16))
    with pytest.raises(RequestError, match="empty"):
        s.add_request(Request("e", []))
    s.add_request(req("a", 15, max_tokens=1))
    with pytest.raises(RequestError, match="already in use"):
        s.add_request(req("a", 3))
    assert s.num_waiting == 1


def test_request_that_could_never_fit_the_pool_is_rejected() -> None:
    s = make(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(RequestError, match="KV pool holds 2 blocks"):
        s.add_request(req("a", 5, max_tokens=8))
    s.add_request(req("b", 5, max_tokens=4))  # at most 8 tokens of K/V: exactly 2 blocks
    assert len(run(s)[0].output_token_ids) == 4


class ConstModel(FakeModel):
    def __init__(self, token: int) -> None:
        super().__init__(4)
        self.token = token

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        return {x.request.request_id: self.token for x in out.scheduled if x.sample}


@pytest.mark.parametrize(
    ("sp", "eos", "n_out", "reason"),
    [
        ({}, (5,), 1, "stop"),
        ({"ignore_eos": True}, (5,), 6, "length"),
        ({"ignore_eos": True, "stop_token_ids": (5,)}, (5,), 1, "stop"),
        ({}, (), 6, "length"),
    ],
)
def test_finish_reasons(
    sp: dict[str, object], eos: tuple[int, ...], n_out: int, reason: str
) -> None:
    s = make()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=6, **sp), eos_token_ids=eos)
    s.add_request(r)
    run(s, ConstModel(5))
    assert (len(r.output_token_ids), r.finish_reason) == (n_out, reason)
    assert r.stop_token == (reason == "stop")  # the gateway leaves its text out


def test_context_length_ends_a_request() -> None:
    s = make(max_model_len=8)
    r = req("a", 5, max_tokens=100)
    s.add_request(r)
    run(s)
    assert r.num_tokens == 8 and r.finish_reason == "length" and len(r.output_token_ids) == 3


def test_logprobs_are_appended_with_each_token() -> None:
    s = make()
    r = req("a", 3, max_tokens=2)
    s.add_request(r)
    for i in range(2):
        out = s.schedule()
        lp = Logprob(11 + i, -0.5 * i, [(11 + i, -0.5 * i), (3, -2.0)])
        s.update(out, {"a": 11 + i}, {"a": lp})
    assert r.output_token_ids == [11, 12]
    assert r.output_logprobs == [
        Logprob(11, 0.0, [(11, 0.0), (3, -2.0)]),
        Logprob(12, -0.5, [(12, -0.5), (3, -2.0)]),
    ]


def test_modules_do_not_import_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import services.attention.block_manager, services.attention.scheduler\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_backpressure_bounds_the_waiting_queue():
    from afd.errors import OverloadedError

    cfg = SchedulerConfig(
        max_num_seqs=1, max_num_batched_tokens=64, max_waiting_requests=2, max_waiting_tokens=1000
    )
    sched = Scheduler(cfg, BlockManager(64, 4), max_model_len=64)
    sched.add_request(Request("a", [1] * 10, SamplingParams(max_tokens=4)))
    sched.add_request(Request("b", [1] * 10, SamplingParams(max_tokens=4)))
    with pytest.raises(OverloadedError, match="2 requests are already waiting"):
        sched.add_request(Request("c", [1] * 10, SamplingParams(max_tokens=4)))
    sched.schedule()  # "a" starts running: one slot frees up in the waiting queue
    sched.add_request(Request("c", [1] * 10, SamplingParams(max_tokens=4)))

    tight = SchedulerConfig(max_waiting_tokens=15)
    sched = Scheduler(tight, BlockManager(64, 4), max_model_len=64)
    sched.add_request(Request("a", [1] * 10, SamplingParams(max_tokens=4)))
    with pytest.raises(OverloadedError, match="prompt tokens are already waiting"):
        sched.add_request(Request("b", [1] * 10, SamplingParams(max_tokens=4)))


def test_max_tokens_zero_scores_the_prompt_and_samples_nothing() -> None:
    """A request for no token (prompt logprobs only): its prompt is computed, in chunks, and it
    finishes ("length") without a sampled token, its blocks back in the pool."""
    s = make(budget=4)
    a = req("a", 10, max_tokens=0)
    s.add_request(a)
    model = FakeModel(4)
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        assert not any(seq.sample for seq in out.scheduled)
        done = s.update(out, model.step(out))
        steps += 1
    assert steps == 3 and done == [a]
    assert a.finish_reason == "length" and a.output_token_ids == []
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
