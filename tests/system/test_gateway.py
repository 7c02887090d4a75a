"""A real `afd serve` cluster (2 FFN + 2 attention + gateway, separate processes, tcp data
plane) driven with the official openai client."""

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from afd.tokenizer import ModelTokenizer
from services.gateway.client import AttentionClient
from services.gateway.detok import TokenBytes

KEY = "sk-system-test"
CHAT = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def start_serve(model, *flags, timeout=90):
    """Start `afd serve` on a free port; return (process, base url, stderr path)."""
    log = model.parent / f"serve-{time.monotonic_ns()}.log"
    argv = [sys.executable, "-m", "afd_cli", "serve", "--model", str(model), "--port", "0"]
    proc = subprocess.Popen(
        [*argv, "--threads", "1", "--kv-cache-gb", "0.05", *flags],
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        m = re.search(r"afd is ready: (\S+)", line)
        if m:
            return proc, m.group(1), log
    proc.kill()
    raise AssertionError("afd serve did not become ready:\n" + log.read_text()[-3000:])


def child_pids(log):
    return [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", log.read_text())]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_step3_checkpoint(
        tmp_path_factory.mktemp("gw") / "tiny", TINY_CONFIG, seed=0, init_std=0.2
    )


@pytest.fixture(scope="module")
def cluster(model):
    proc, url, log = start_serve(
        model, "--attention", "2", "--ffn", "2", "--transport", "tcp", "--api-key", KEY,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    yield url, log
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    pids = child_pids(log)
    assert len(pids) == 5 and not any(alive(p) for p in pids), "orphaned children"


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster[0], api_key=KEY, max_retries=0, timeout=60)


def attention_addresses(log):
    return re.findall(r"attention server listening on (\S+)", log.read_text())


def wait_idle(log, timeout=5.0):
    """Every attention server: nothing running or waiting, no KV block held."""

    async def stats():
        out = []
        for address in attention_addresses(log):
            c = AttentionClient(address)
            out.append(await c.stats())
            await c.close()
        return out

    deadline = time.monotonic() + timeout
    while True:
        s = asyncio.run(stats())
        if len(s) == 2 and all(x.running == x.waiting == 0 and x.kv_usage == 0 for x in s):
            return
        assert time.monotonic() < deadline, f"attention servers still busy: {s}"
        time.sleep(0.1)


def test_ready_health_models(cluster, client):
    url = cluster[0].removesuffix("/v1")
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").json()["status"] == "ready"
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_chat_stream_equals_non_stream_and_usage(client):
    args = dict(model="tiny", messages=CHAT, max_tokens=12, **GREEDY)
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 12
    tok = httpx.post(
        str(client.base_url).replace("/v1/", "/tokenize"),
        json={"messages": CHAT},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    assert whole.usage.prompt_tokens == tok["count"]


def test_greedy_matches_afd_generate(model, cluster, client):
    n = 10
    out = subprocess.run(
        [sys.executable, "-m", "afd_cli", "generate", "--model", str(model), "--chat"]
        + ["--prompt", CHAT[0]["content"], "--json", "--temperature", "0", "--ignore-eos"]
        + ["--max-tokens", str(n), "--ffn-shards", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    expected = json.loads(out.stdout)["results"][0]
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=n, logprobs=True, **GREEDY
    )
    assert chat.choices[0].message.content == expected["text"]
    # Token for token: chat logprobs carry each token's exact bytes.
    tb = TokenBytes(ModelTokenizer(model))
    got = [bytes(e.bytes) for e in chat.choices[0].logprobs.content]
    assert got == [tb(i) for i in expected["token_ids"]]
    # The same prompt as token ids on /v1/completions.
    tok = httpx.post(
        cluster[0].removesuffix("/v1") + "/tokenize",
        json={"messages": CHAT},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    comp = client.completions.create(model="tiny", prompt=tok["tokens"], max_tokens=n, **GREEDY)
    assert comp.choices[0].text == expected["text"]


def test_completion_prompt_shapes_and_echo(client):
    one = client.completions.create(model="tiny", prompt="abc", max_tokens=3, **GREEDY)
    ids = client.completions.create(model="tiny", prompt=[97, 98, 99], max_tokens=3, **GREEDY)
    assert one.choices[0].text == ids.choices[0].text
    many = client.completions.create(
        model="tiny", prompt=[[97, 98, 99], [120, 121]], max_tokens=3, **GREEDY
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == one.choices[0].text
    assert many.usage.prompt_tokens == 5 and many.usage.completion_tokens == 6
    echo = client.completions.create(model="tiny", prompt="abc", max_tokens=3, echo=True, **GREEDY)
    assert echo.choices[0].text == "abc" + one.choices[0].text


def test_stop_string_is_matched_and_never_leaked(client):
    args = dict(model="tiny", prompt="hello", max_tokens=24, **GREEDY)
    text = client.completions.create(**args).choices[0].text
    i = next(
        i
        for i in range(1, len(text) - 2)
        if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
    )
    stop = text[i : i + 2]  # two byte tokens: the stop string spans a token boundary
    cut = client.completions.create(**args, stop=[stop, "never-there"])
    assert cut.choices[0].text == text[:i] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**args, stop=stop, stream=True)
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == text[:i]


def test_a_stop_token_ends_the_text_before_it_unless_asked(model, client):
    """The attention server says which token ended the output (over gRPC): as vLLM, its text
    is left out, and kept with include_stop_str_in_output."""
    tok = ModelTokenizer(model)
    args = dict(model="tiny", prompt="hello", max_tokens=40, **GREEDY)
    text = client.completions.create(**args).choices[0].text
    i = next(i for i in range(2, len(text)) if text[i].isascii() and text[i] not in text[:i])
    (stop,) = tok.encode(text[i])  # a character of the demo's byte-level tokens: one token
    extra = {**GREEDY["extra_body"], "stop_token_ids": [stop]}
    cut = client.completions.create(**{**args, "extra_body": extra}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:i]
    kept = {**extra, "include_stop_str_in_output": True}
    cut = client.completions.create(**{**args, "extra_body": kept}).choices[0]
    assert cut.text == text[: i + 1]


def test_reset_prefix_cache_forgets_what_the_servers_cached(cluster, client):
    """vLLM's /reset_prefix_cache over the control plane: a prompt found in the cache is
    computed whole again after it (and the route needs the API key)."""
    prompt = "a prompt long enough to fill two or three blocks of the cache " * 2
    args = dict(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    client.completions.create(**args)
    again = client.completions.create(**args)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    url = cluster[0].removesuffix("/v1")
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 401
    r = httpx.post(f"{url}/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["forgotten_blocks"] > 0
    cold = client.completions.create(**args)
    assert (
        not cold.usage.prompt_tokens_details or not cold.usage.prompt_tokens_details.cached_tokens
    )
    assert cold.choices[0].text == again.choices[0].text


def test_max_tokens_zero_without_echo_answers_nothing(client):
    """The attention server ends a max_tokens 0 request at once (the gateway unit tests' fake
    server does the same: the HTTP fuzz relies on it)."""
    c = client.completions.create(model="tiny", prompt="hi", max_tokens=0).choices[0]
    assert (c.text, c.finish_reason) == ("", "length")


def test_a_priority_needs_the_priority_policy(client):
    """The request's priority crosses the wire; this cluster schedules first come, first
    served, so its attention servers refuse one, naming the flag (a 400), and go on serving."""
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={"priority": 3}
        )
    ok = client.completions.create(
        model="tiny", prompt="hi", max_tokens=2, extra_body={"priority": 0}
    )
    assert ok.choices[0].text is not None


def test_responses_api_answers_as_the_chat_it_stands_for(client):
    """The official client's Responses calls (whole, and its streaming helper, which checks
    every event against the snapshot it builds) give the chat's greedy answer; cut at
    max_output_tokens, the response is incomplete (the helper's get_final_response waits for
    response.completed only, so its events are read)."""
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    args = dict(model="tiny", input=CHAT[0]["content"], max_output_tokens=6, temperature=0)
    whole = client.responses.create(**args)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(**args) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == whole.output_text


def test_stored_responses_go_on_as_the_chat_of_the_whole_conversation(client):
    """The official client's stored-response calls: a turn that goes on from a response by
    previous_response_id answers as the chat of the whole conversation; a background response
    polled to its end answers as the same request run whole; its input is listed; deleted, it
    is gone (the client's NotFoundError)."""
    import openai

    args = dict(model="tiny", max_output_tokens=6, temperature=0)
    first = client.responses.create(input=CHAT[0]["content"], **args)
    second = client.responses.create(input="and then?", previous_response_id=first.id, **args)
    messages = [
        *CHAT,
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and then?"},
    ]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                          temperature=0)  # fmt: skip
    assert second.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(second.id).output_text == second.output_text
    queued = client.responses.create(input=CHAT[0]["content"], background=True, **args)
    assert queued.status in ("queued", "in_progress", "incomplete")
    deadline = time.monotonic() + 60
    done = queued
    while done.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        done = client.responses.retrieve(queued.id)
    assert done.status == "incomplete" and done.output_text == first.output_text
    (item,) = client.responses.input_items.list(second.id).data
    assert item.content[0].text == "and then?"
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_a_background_stream_left_early_is_resumed_where_it_was_left(client):
    """The official client streams a background response, leaves after a few events (closing
    the connection), and resumes with retrieve(stream=True, starting_after=...): the events
    it gets are the rest, and the text adds up to the same request answered whole."""
    args = dict(model="tiny", input=CHAT[0]["content"], max_output_tokens=24, temperature=0)
    whole = client.responses.create(**args, store=False)
    stream = client.responses.create(**args, background=True, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    stream.close()  # the client leaves; the generation runs on
    rid = seen[0].response.id
    rest = list(
        client.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number)
    )
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert text == whole.output_text and rest[-1].type == "response.incomplete"
    assert client.responses.retrieve(rid).output_text == whole.output_text


def test_afd_chat_and_complete_talk_to_the_server_as_its_api_answers(cluster, client):
    """`afd chat` (one question, then a conversation from stdin, its history kept) and `afd
    complete` print what the API answers the same requests; a wrong key is one line and
    exit status 2."""
    url = cluster[0]
    cli = [sys.executable, "-m", "afd_cli", "--log-level", "WARNING"]
    opts = ["--url", url, "--api-key", KEY, "--max-tokens", "6", "--temperature", "0"]

    def afd(*argv, stdin=""):
        return subprocess.run([*cli, *argv, *opts], input=stdin, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    def chat(messages):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                           temperature=0)  # fmt: skip
        return r.choices[0].message.content

    one = afd("chat", "-q", "hi there")
    assert one.returncode == 0, one.stderr
    assert one.stdout == chat([{"role": "user", "content": "hi there"}]) + "\n"
    talk = afd("chat", "--system-prompt", "be brief", stdin="hi there\nand then?\n")
    first = chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    )
    second = chat([
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": first}, {"role": "user", "content": "and then?"},
    ])  # fmt: skip
    assert talk.returncode == 0 and talk.stdout == f"{first}\n{second}\n", talk.stderr
    done = afd("complete", "-q", "once upon")
    want = client.completions.create(model="tiny", prompt="once upon", max_tokens=6,
                                      temperature=0).choices[0].text  # fmt: skip
    assert done.returncode == 0 and done.stdout == want + "\n", done.stderr
    wrong = subprocess.run([*cli, "chat", "-q", "hi", "--url", url, "--api-key", "nope"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: the server answered 401")
    assert wrong.stderr.count("\n") == 1


def test_n_and_seeds_are_reproducible(client):
    args = dict(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, n=3, seed=1234)
    a = [c.message.content for c in client.chat.completions.create(**args).choices]
    b = [c.message.content for c in client.chat.completions.create(**args).choices]
    assert a == b and len(set(a)) == 3  # reproducible, and the choices differ
    other = client.chat.completions.create(**{**args, "seed": 99, "n": 1})
    assert other.choices[0].message.content != a[0]


def test_logprobs(client):
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the top one
    c = client.completions.create(model="tiny", prompt="hi", max_tokens=4, logprobs=2, **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4


def test_logit_bias_and_penalties_reach_the_sampler(model, client):
    """A +100 bias makes greedy repeat one token; a repetition penalty on it (vLLM extra) and a
    frequency penalty are applied after the bias, and min_p is accepted."""
    tok = ModelTokenizer(model)
    t = tok.encode(" cat")[-1]
    args = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    args |= {"logit_bias": {str(t): 100}}
    forced = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tok.decode([t] * 4)
    extra = {"ignore_eos": True, "repetition_penalty": 1e6, "min_p": 0.1}
    other = client.completions.create(**args, frequency_penalty=2.0, extra_body=extra)
    assert other.choices[0].text.startswith(tok.decode([t]))  # the penalties act from then on
    assert other.choices[0].text != forced.choices[0].text
    # min_tokens (vLLM extra): a stop string ends the output only once that many are out
    stopped = client.completions.create(**args, stop=[tok.decode([t])])
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(**args, stop=[tok.decode([t])], extra_body={"min_tokens": 2})
    assert held.choices[0].text == tok.decode([t] * 2)
    assert held.choices[0].finish_reason == "stop"


def test_structured_outputs(client):
    """response_format (OpenAI), structured_outputs and guided_* (vLLM) reach the attention
    server's grammars: answers fit; a guide that does not compile is a 400."""
    no_space = {str(b): -100 for b in b"\t\n\r "}  # the random model loves optional blanks
    schema = {
        "type": "object",
        "properties": {"pet": {"enum": ["cat", "dog"]}, "n": {"type": "boolean"}},
        "required": ["pet", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=60, response_format=fmt, logit_bias=no_space,
        temperature=0,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"pet", "n"} and obj["pet"] in ("cat", "dog") and isinstance(obj["n"], bool)
    for extra in (
        {"guided_choice": ["red", "green"]},
        {"structured_outputs": {"choice": ["red", "green"]}},
    ):
        c = client.completions.create(
            model="tiny", prompt="colour:", max_tokens=10, temperature=0.8, seed=3, extra_body=extra
        )
        assert c.choices[0].text in ("red", "green") and c.choices[0].finish_reason == "stop"
    c = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"},
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", c.choices[0].text), c.choices[0].text
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="does not compile"):
            client.completions.create(
                model="tiny", prompt="x", max_tokens=4, stream=stream,
                extra_body={"guided_regex": "(a"},
            )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="only one of"):
        client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=4, response_format={"type": "json_object"},
            extra_body={"guided_regex": "a"},
        )  # fmt: skip
    # vLLM's structural tag (xgrammar's form; the older one is written in it, a unit test
    # holds that to xgrammar's own conversion): here one tag holding the schema's JSON, forced
    tag = {"type": "tag", "begin": "<function=pet>", "end": "</function>",
           "content": {"type": "json_schema", "json_schema": schema}}  # fmt: skip
    fmt = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"],
           "tags": [tag], "at_least_one": True, "stop_after_first": True}}  # fmt: skip
    c = client.completions.create(
        model="tiny", prompt="x", max_tokens=60, temperature=0, logit_bias=no_space,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    text = c.choices[0].text
    assert text.startswith("<function=pet>") and "</function>" in text, text
    obj = json.loads(text[len("<function=pet>") : text.index("</function>")])
    assert set(obj) == {"pet", "n"} and obj["pet"] in ("cat", "dog"), text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments) of each call in an openai client stream, and its finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, ["", ""])
                c[0] += (d.function.name or "") if d.function else ""
                c[1] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_calls(client):
    """tools through the official client: a named function and "required" guide the output
    into calls; with "auto" the server's Hermes parser reads a call the model wrote (a regex
    guide writes it: this random model never calls on its own); streamed calls add up to the
    whole ones; the call and its result go back in the next turn."""
    no_space = {str(b): -100 for b in b"\t\n\r "}
    opts = {"model": "tiny", "messages": CHAT, "tools": [WEATHER], "max_tokens": 60}
    opts |= {"temperature": 0, "logit_bias": no_space}
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**opts, tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "stop"

    r = client.chat.completions.create(**opts, tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"

    regex = r'Let me check\.<tool_call>\{"name": "get_weather", "arguments": '
    regex += r'\{"city": "Rome"\}\}</tool_call>'
    auto = {**opts, "max_tokens": 120, "extra_body": {"guided_regex": regex}}
    r = client.chat.completions.create(**auto)
    msg = r.choices[0].message
    assert msg.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Rome"},
    )
    calls, finish = _streamed_calls(client.chat.completions.create(**auto, stream=True))
    assert calls == [(call.function.name, call.function.arguments)] and finish == "tool_calls"

    turn = [
        *CHAT,
        {"role": "assistant", "content": msg.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        **{**opts, "messages": turn, "max_tokens": 8}, tool_choice="none"
    )
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > 100
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            **opts, tool_choice={"type": "function", "function": {"name": "nope"}}
        )


def test_bad_requests_get_openai_errors_and_leave_nothing_allocated(cluster, client):
    url, log = cluster
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bad = [
        (b"{not json", 400),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "ten"}), 400),
        (json.dumps({"model": "nope", "prompt": "x"}), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 10**9}), 400),
        (json.dumps({"model": "tiny", "prompt": "x" * 600}), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "temperature": -1}), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "n": 10**6}), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "logit_bias": {"cat": 1}}), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "logit_bias": {"10000000": 1}}), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "repetition_penalty": 0}), 400),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 3}), 400),
        (json.dumps({"model": "tiny", "prompt": "x" * (5 << 20)}), 413),
    ]
    for body, status in bad:
        r = httpx.post(f"{url}/completions", content=body, headers=h, timeout=30)
        assert r.status_code == status, (body[:80], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10**6)
    wait_idle(log)


def test_api_key(cluster):
    url = cluster[0]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    r = httpx.get(f"{url}/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for pid in child_pids(cluster[1]):  # the key is not on any command line
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()


def test_request_id_is_honoured(client):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=CHAT, max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().id == "chatcmpl-trace-42"


def test_client_disconnect_aborts_the_request(cluster):
    url, log = cluster
    body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{url}/completions", json=body, headers=h, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert next(lines) == ""
    # Non-streaming too: the client times out and hangs up long before 3 x 400 tokens.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{url}/completions", json={**body, "stream": False, "n": 3}, headers=h, timeout=0.5
        )
    wait_idle(log)
