"""The priority scheduling policy (vLLM's `--scheduling-policy priority`): admission by
(priority, arrival), the least urgent running request preempted first even when it was already
planned for the step, and the fcfs policy refusing a priority. Driven by the fabricated model of
test_scheduler.py, whose outputs change if any block table or token is wrong."""

from __future__ import annotations

import pytest

from afd.config import SchedulerConfig
from afd.errors import ConfigError, RequestError
from services.attention.block_manager import BlockManager
from services.attention.request import Request, RequestStatus
from services.attention.scheduler import Scheduler
from tests.unit.test_scheduler import FakeModel, check_invariants, make, outputs, req, run


def make_priority(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 64,
) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, scheduling_policy="priority")
    return Scheduler(cfg, BlockManager(num_blocks, block_size), max_model_len)


def ids(reqs: list[Request]) -> list[str]:
    return [r.request_id for r in reqs]


def test_admission_goes_by_priority_then_arrival() -> None:
    s = make_priority(max_num_seqs=1)
    prios = {"r0": 0, "r1": 2, "r2": -1, "r3": 0, "r4": -1}
    for rid, p in prios.items():
        s.add_request(req(rid, 3, max_tokens=2, priority=p))
    assert ids(run(s)) == ["r2", "r4", "r0", "r3", "r1"]


def test_an_urgent_late_arrival_is_next_but_does_not_displace_a_running_request() -> None:
    s = make_priority(max_num_seqs=1)
    a = req("a", 3, max_tokens=4, priority=3)
    s.add_request(a)
    model = FakeModel(4)
    out = s.schedule()
    s.update(out, model.step(out))
    s.add_request(req("b", 3, max_tokens=2))
    s.add_request(req("c", 3, max_tokens=2, priority=-5))
    out = s.schedule()
    assert ids([x.request for x in out.scheduled]) == ["a"]
    s.update(out, model.step(out))
    assert ids(run(s, model)) == ["a", "c", "b"]


def test_the_least_urgent_is_preempted_even_when_already_planned() -> None:
    # 4 blocks of 2 tokens. a came first and is planned first; then b needs a 3rd block and
    # none is free. Under fcfs b (the tail) would go; here a is less urgent, and its plan for
    # the step is taken back.
    s = make_priority(num_blocks=4, block_size=2)
    a, b = req("a", 2, max_tokens=5, priority=5), req("b", 4, max_tokens=4, priority=0)
    s.add_request(a)
    model = FakeModel(2)
    out = s.schedule()
    s.update(out, model.step(out))
    s.add_request(b)
    out = s.schedule()  # a grows to 2 blocks, b is admitted into the other 2
    assert ids([x.request for x in out.scheduled]) == ["a", "b"]
    s.update(out, model.step(out))
    out = s.schedule()
    check_invariants(s, out)
    assert out.preempted == ["a"] and ids([x.request for x in out.scheduled]) == ["b"]
    assert out.num_batched_tokens == 1
    assert a.status is RequestStatus.WAITING and a.block_ids == [] and a.num_preemptions == 1
    s.update(out, model.step(out))
    run(s, model)
    ref = make()
    ref.add_request(req("a", 2, max_tokens=5))
    ref.add_request(req("b", 4, max_tokens=4))
    assert outputs(run(ref)) == outputs([a, b])


def test_a_request_that_preempts_itself_leaves_the_rest_of_the_step_to_others() -> None:
    s = make_priority(num_blocks=4, block_size=2, max_num_seqs=2)
    y = req("y", 3, max_tokens=6, priority=9)
    s.add_request(y)
    model = FakeModel(2)
    out = s.schedule()  # y alone: 2 blocks
    s.update(out, model.step(out))
    z = req("z", 3, max_tokens=3, priority=0)
    s.add_request(z)
    out = s.schedule()  # y decodes in its 2 blocks, z is admitted into the other 2
    assert ids([x.request for x in out.scheduled]) == ["y", "z"]
    s.update(out, model.step(out))
    out = s.schedule()  # y needs a 3rd block; the least urgent is y itself
    check_invariants(s, out)
    assert out.preempted == ["y"] and ids([x.request for x in out.scheduled]) == ["z"]
    s.update(out, model.step(out))
    assert ids(run(s, model)) == ["z", "y"]


def test_a_preempted_request_keeps_its_place_by_priority_and_arrival() -> None:
    s = make_priority(num_blocks=4, block_size=2, max_num_seqs=2)
    a, b = req("a", 3, max_tokens=5, priority=1), req("b", 4, max_tokens=4, priority=0)
    for r in (a, b):
        s.add_request(r)
    model = FakeModel(2)
    out = s.schedule()
    s.update(out, model.step(out))
    later = [req("c", 2, max_tokens=1, priority=1), req("d", 2, max_tokens=1, priority=0)]
    for r in later:
        s.add_request(r)
    out = s.schedule()  # b needs a 3rd block: a (priority 1) is preempted
    assert out.preempted == ["a"]
    # d is more urgent than a; a came before c, which has its priority
    assert ids(list(s._waiting)) == ["d", "a", "c"]
    s.update(out, model.step(out))
    run(s, model)


def test_preemption_by_priority_under_pressure_gives_the_unconstrained_outputs() -> None:
    def workload() -> list[Request]:
        return [
            req(f"r{i}", 3 + (5 * i) % 11, max_tokens=4 + (3 * i) % 9, priority=(7 * i) % 5 - 2)
            for i in range(12)
        ]

    ref = make_priority(num_blocks=256, budget=512, max_num_seqs=16, max_model_len=32)
    for r in workload():
        ref.add_request(r)
    expected = outputs(run(ref))
    assert ref.num_preemptions == 0
    s = make_priority(num_blocks=10, block_size=4, budget=16, max_num_seqs=6, max_model_len=32)
    reqs = workload()
    for r in reqs:
        s.add_request(r)
    got = run(s)
    assert s.num_preemptions > 0
    assert outputs(got) == expected
    urgent = [r for r in reqs if r.sampling.priority == -2]
    assert all(r.num_preemptions == 0 for r in urgent)  # never the least urgent


def test_fcfs_refuses_a_priority_and_the_policy_is_checked() -> None:
    s = make()
    with pytest.raises(RequestError, match="--scheduling-policy priority"):
        s.add_request(req("a", 3, priority=1))
    assert s.num_waiting == 0
    s.add_request(req("b", 3, priority=0))
    with pytest.raises(ConfigError, match="scheduling policy"):
        SchedulerConfig(scheduling_policy="lottery")


def test_abort_a_waiting_request_under_priority() -> None:
    s = make_priority(max_num_seqs=1)
    for rid, p in (("a", 0), ("b", -1), ("c", 1)):
        s.add_request(req(rid, 3, max_tokens=2, priority=p))
    assert s.abort("a")
    assert ids(run(s)) == ["b", "c"]
