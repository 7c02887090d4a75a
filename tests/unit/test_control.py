"""The control plane's contract (afd.control): every type survives its protobuf round trip, the
one error-code enum maps both ways, and bad sampling values are refused where they enter."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from afd import control
from afd.control import (
    ErrorCode,
    GenerateRequest,
    Health,
    Logprob,
    SamplingParams,
    Stats,
    TokenEvent,
)
from afd.errors import OverloadedError, RequestError, TransportError

REPO = Path(__file__).resolve().parents[2]


def test_generate_request_round_trip():
    sp = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_k=3,
        top_p=0.9,
        seed=-12,
        stop_token_ids=(4, 9),
        ignore_eos=True,
        logprobs=2,
        cache_salt="tenant-7",
        logit_bias=((3, -100.0), (40, 2.5)),
        repetition_penalty=1.25,
        frequency_penalty=-0.5,
        presence_penalty=1.5,
        min_p=0.125,
        min_tokens=3,
        guide_kind="regex",
        guide="a+",
        guide_after=(7, 8),
        bad_words=((5,), (6, 7)),
        allowed_token_ids=(1, 2, 3),
    )
    req = GenerateRequest("r-1", [1, 2, 3], sp)
    back = control.request_from_pb(control.request_to_pb(req))
    assert back.request_id == "r-1" and back.prompt_token_ids == [1, 2, 3]
    assert back.sampling.top_p == pytest.approx(0.9)  # a float32 on the wire
    assert replace(back.sampling, top_p=0.9) == sp
    # unset optionals stay unset (no seed, no logprobs), not zero
    plain = control.sampling_from_pb(control.sampling_to_pb(SamplingParams(max_tokens=1)))
    assert plain.seed is None and plain.logprobs is None and plain.top_p == 1.0
    assert plain.repetition_penalty == 1.0 and not plain.adjusts_logits


def test_token_event_round_trip_keeps_logprobs_and_codes():
    ev = TokenEvent(
        "r",
        [5, 6],
        [Logprob(5, -0.25, [(5, -0.25), (1, -3.0)]), Logprob(6, -1.0, [])],
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=2,
        queue_seconds=0.125,
        cached_tokens=16,
        stop_token=True,
    )
    assert control.event_from_pb(control.event_to_pb(ev)) == ev
    for code in ErrorCode:
        failed = TokenEvent.failure("r", code, "why") if code else TokenEvent("r", [])
        back = control.event_from_pb(control.event_to_pb(failed))
        assert back.error_code is code
        assert back.failed == bool(code)


def test_health_and_stats_round_trip():
    h = Health(True, False, "FFN down", "m", 4096, draining=True)
    assert control.health_from_pb(control.health_to_pb(h)) == h
    s = Stats(
        running=3,
        waiting=1,
        kv_usage=0.5,
        preemptions=7,
        draining=True,
        prefix_queries=400,
        prefix_hits=300,
    )
    assert control.stats_from_pb(control.stats_to_pb(s)) == s


def test_each_error_type_carries_its_code():
    assert RequestError("x").code is ErrorCode.INVALID_REQUEST
    assert OverloadedError("x").code is ErrorCode.OVERLOADED
    assert TransportError("x").code is ErrorCode.UNAVAILABLE


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": -1},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"logprobs": -1},
        {"prompt_logprobs": -1},
        {"stop_token_ids": (-3,)},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("nan")},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3.0},
        {"min_p": 1.5},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((5, 101.0),)},
        {"logit_bias": ((5, float("nan")),)},
        {"logit_bias": ((5, 1.0), (5, 2.0))},
        {"logit_bias": tuple((i, 1.0) for i in range(2000))},
        {"min_tokens": -1},
        {"max_tokens": 2, "min_tokens": 3},
        {"guide_after": (3,)},  # nothing to wait for
        {"guide_kind": "regex", "guide": "a", "guide_after": (-3,)},
        {"guide_kind": "regex", "guide": "a", "guide_after": tuple(range(17))},
        {"bad_words": ((),)},
        {"bad_words": ((1, -2),)},
        {"allowed_token_ids": (-1,)},
    ],
)
def test_sampling_values_no_request_may_carry_are_refused(bad):
    with pytest.raises(RequestError):
        SamplingParams(**bad)


def test_a_hostile_generate_request_is_refused_by_type():
    msg = control.request_to_pb(GenerateRequest("r", [1], SamplingParams()))
    msg.sampling.temperature = -2.0
    with pytest.raises(RequestError, match="temperature"):
        control.request_from_pb(msg)


def test_the_contract_loads_no_torch():
    code = "import sys; sys.modules['torch'] = None\nimport afd.control\n"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
