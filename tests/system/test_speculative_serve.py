"""`afd serve --speculative-config` through the HTTP API with the official openai client: the
same answers as the same server without it (greedy), streamed in fewer chunks than tokens (a
step's kept drafts reach the gateway as one event), stop strings and usage as without."""

from __future__ import annotations

import openai
import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from tests.system.metrics_helpers import scrape, serve, value

KEY = "sk-spec-test"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["hello hello hello", "one two three one two three one", "abcabcabc"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = write_step3_checkpoint(
        tmp_path_factory.mktemp("spec") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )
    out = {}
    flags = ("--transport", "inproc", "--a2f-dtype", "bf16", "--api-key", KEY)
    try:
        # the drafting server without bursts: a burst's steps draft nothing, and these prompts
        # keep a draft only at a step or two (the plain server bursts: the same tokens)
        spec = ("--speculative-config", SPEC, "--num-scheduler-steps", "1")
        for name, extra in (("plain", ()), ("spec", spec)):
            out[name] = serve(model, *flags, *extra)
        yield out
    finally:
        for served in out.values():
            served.stop()


@pytest.fixture(scope="module")
def clients(servers):
    return {
        name: openai.OpenAI(base_url=s.url, api_key=KEY, max_retries=0, timeout=60)
        for name, s in servers.items()
    }


def test_greedy_answers_equal_and_arrive_in_fewer_chunks(clients):
    chunks_seen = tokens_seen = 0
    for prompt in PROMPTS:
        args = dict(model="tiny", prompt=prompt, max_tokens=32, **GREEDY)
        want = clients["plain"].completions.create(**args)
        got = clients["spec"].completions.create(**args)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens == 32
        stream = clients["spec"].completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want.choices[0].text
        chunks_seen += sum(1 for c in chunks if c.choices and c.choices[0].text)
        tokens_seen += chunks[-1].usage.completion_tokens
    assert chunks_seen < tokens_seen  # some events carried kept drafts


def test_a_stop_string_inside_kept_drafts_cuts_the_text_there(clients):
    args = dict(model="tiny", prompt=PROMPTS[1], max_tokens=32, **GREEDY)
    text = clients["plain"].completions.create(**args).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for name in ("plain", "spec"):
        cut = clients[name].completions.create(**args, stop=[stop])
        assert cut.choices[0].text == text[: text.find(stop)], name
        assert cut.choices[0].finish_reason == "stop"


def test_chat_with_logprobs_and_penalties_decodes_as_without(clients):
    """Requests with logprobs or a penalty (they draft too): the same answers as without."""
    msgs = [{"role": "user", "content": "say it again and again"}]
    for extra in ({"logprobs": True, "top_logprobs": 2}, {"frequency_penalty": 0.5}):
        args = dict(model="tiny", messages=msgs, max_tokens=16, **GREEDY, **extra)
        want = clients["plain"].chat.completions.create(**args).choices[0]
        got = clients["spec"].chat.completions.create(**args).choices[0]
        assert got.message.content == want.message.content
        if "logprobs" in extra:
            assert len(got.logprobs.content) == 16


def test_the_attention_servers_metrics_count_the_drafts(clients, servers):
    """Drafts verified and kept, and kept by position, add up. The first test's requests,
    whose answers keep drafts, so the test needs no other test before it."""
    for prompt in PROMPTS:
        clients["spec"].completions.create(model="tiny", prompt=prompt, max_tokens=32, **GREEDY)
    (url,) = [u for name, u in servers["spec"].metrics.items() if name.startswith("attention")]
    att = scrape(url)
    steps = value(att, "afd_spec_decode_num_drafts_total")
    drafted = value(att, "afd_spec_decode_num_draft_tokens_total")
    kept = value(att, "afd_spec_decode_num_accepted_tokens_total")
    assert 0 < kept <= drafted and steps <= drafted <= 4 * steps
    at = [value(att, "afd_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
          for i in range(4)]  # fmt: skip
    assert sum(at) == kept and at == sorted(at, reverse=True) and at[0] <= steps
