"""The gateway's beam search on a hand-computed case: a four-token model whose next-token
log-probabilities depend only on the last token, EOS = 3. Worked by hand below (width 2, one
prompt token, two steps):

step 1 from [0]: 1 (-0.1), 2 (-0.5), EOS (-0.3: the hypothesis [] ends, cum -0.3)
step 2 from [1] (-0.1): EOS -0.15 ends [1]; [1,1] -1.1 ... from [2] (-0.5): [2,2] -0.7,
[2,1] -0.95, EOS -2.5 ends [2]. Live: [2,2], [2,1].
Ranked by cum / (1 + output length) ** length_penalty: with 1, [1] -0.075, [2,2] -0.233,
[] -0.3, [2,1] -0.317, [2] -1.25; with 0, [1] -0.15, [] -0.3, [2,2] -0.7.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest

from afd.control import Logprob, SamplingParams, TokenEvent
from services.gateway.beam_search import BeamOptions, search
from services.gateway.errors import APIError
from services.gateway.generation import ChoiceSpec

NEXT = {
    0: {1: -0.1, 2: -0.5, 3: -0.3, 0: -3.0},
    1: {3: -0.05, 1: -1.0, 2: -2.0, 0: -3.0},
    2: {2: -0.2, 1: -0.45, 3: -2.0, 0: -3.0},
    3: {0: -0.1, 1: -1.0, 2: -2.0, 3: -3.0},
}


class FakeClient:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.status = 503
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, request_id, prompt, params):
        self.calls.append((list(prompt), params))
        if self.fail:
            raise APIError(self.status, "attention server gone", "unavailable")
        top = sorted(NEXT[prompt[-1]].items(), key=lambda kv: -kv[1])[: params.logprobs]
        t, lp = top[0]
        yield TokenEvent(request_id, [t], [Logprob(t, lp, top)], "length")


class FakeBalancer:
    """Picks the first client not excluded; a 503 is the server's own (it retries), any other
    error the request's."""

    def __init__(self, *clients):
        self.clients = clients
        self.failures: list[FakeClient] = []

    def pick(self, exclude=(), prompt=None):
        left = [c for c in self.clients if c not in exclude]
        if not left:
            raise APIError(503, "no attention server left", "unavailable")
        return left[0]

    async def failed(self, client, error):
        self.failures.append(client)
        return error.status == 503

    @contextmanager
    def lease(self, client):
        yield


def _search(client, length_penalty=1.0, ignore_eos=False, include_stop=False):
    spec = ChoiceSpec(0, "r", [0], SamplingParams(max_tokens=2))
    opts = BeamOptions(2, length_penalty, 3, ignore_eos, include_stop)
    return asyncio.run(search(FakeBalancer(client), spec, opts))


def test_finished_hypotheses_and_live_beams_ranked_with_the_length_penalty():
    client = FakeClient()
    got = _search(client)
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in got] == [
        ((1,), "stop", 3),
        ((2, 2), "length", None),
    ]
    assert [b.cum_logprob for b in got] == pytest.approx([-0.15, -0.7])
    # every step asks for 2 x width alternatives of each live beam, and nothing is sampled
    assert [p for p, _ in client.calls] == [[0], [0, 1], [0, 2]]
    params = client.calls[0][1]
    assert (params.logprobs, params.max_tokens, params.temperature) == (4, 1, 0.0)


def test_no_length_penalty_ranks_by_cumulative_logprob():
    got = _search(FakeClient(), length_penalty=0.0)
    assert [(b.tokens, b.finish_reason) for b in got] == [((1,), "stop"), ((), "stop")]


def test_ignore_eos_keeps_eos_as_a_token_and_include_stop_keeps_it_in_the_beam():
    got = _search(FakeClient(), ignore_eos=True)
    assert [b.tokens for b in got] == [(1, 3), (3, 0)]
    assert all(b.finish_reason == "length" for b in got)
    best = _search(FakeClient(), include_stop=True)[0]
    assert best.tokens == (1, 3) and best.finish_reason == "stop"  # same rank: EOS not counted


def test_a_failed_step_fails_the_search():
    with pytest.raises(APIError, match="gone"):
        _search(FakeClient(fail=True))


def test_a_step_a_server_fails_goes_to_another_and_the_search_is_the_same():
    spec = ChoiceSpec(0, "r", [0], SamplingParams(max_tokens=2))
    opts = BeamOptions(2, 1.0, 3, False, False)
    gone, alive = FakeClient(fail=True), FakeClient()
    balancer = FakeBalancer(gone, alive)
    got = asyncio.run(search(balancer, spec, opts))
    assert [b.tokens for b in got] == [b.tokens for b in _search(FakeClient())]
    assert gone.calls and alive.calls and balancer.failures
    # a failure of the request's own (a 400-class one) is never retried
    refused = FakeClient(fail=True)
    refused.status = 400
    with pytest.raises(APIError):
        asyncio.run(search(FakeBalancer(refused, FakeClient()), spec, opts))


def test_logprobs_come_with_each_beams_tokens():
    spec = ChoiceSpec(0, "r", [0], SamplingParams(max_tokens=2))
    client = FakeClient()
    opts = BeamOptions(2, 1.0, 3, logprobs=1)
    best, second = asyncio.run(search(FakeBalancer(client), spec, opts))
    assert client.calls[0][1].logprobs == 4  # the search's 2 x width, which covers 1
    assert best.tokens == (1,) and [lp.token_id for lp in best.logprobs] == [1]
    assert best.logprobs[0].logprob == -0.1 and best.logprobs[0].top == [(1, -0.1)]
    assert [(lp.token_id, lp.logprob) for lp in second.logprobs] == [(2, -0.5), (2, -0.2)]
    opts = BeamOptions(2, 1.0, 3, include_stop=True, logprobs=0)
    best = asyncio.run(search(FakeBalancer(FakeClient()), spec, opts))[0]
    assert [lp.token_id for lp in best.logprobs] == [1, 3]  # the EOS kept, with its logprob


def test_what_the_search_cannot_honour_is_refused_and_neutral_values_are_not():
    from services.gateway.beam_search import check_request
    from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

    neutral = {"repetition_penalty": 1.0, "stop_token_ids": [], "presence_penalty": 0.0}
    check_request(CompletionRequest(prompt="x", use_beam_search=True, **neutral))
    for bad, param in (({"stop": "x"}, "stop"), ({"min_tokens": 2}, "min_tokens"),
                       ({"repetition_penalty": 1.1}, "repetition_penalty")):  # fmt: skip
        with pytest.raises(APIError, match="beam search does not take") as e:
            check_request(CompletionRequest(prompt="x", use_beam_search=True, **bad))
        assert e.value.param == param
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required"
    )
    with pytest.raises(APIError, match="tool_choice"):
        check_request(chat)
