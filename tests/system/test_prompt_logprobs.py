"""Prompt logprobs through the OpenAI API of a real `afd serve`: the legacy completions' echo
with logprobs (how lm-evaluation-harness scores loglikelihood tasks: max_tokens 0 or 1) and
vLLM's `prompt_logprobs`, equal to transformers' teacher-forced log-softmax of the prompt
within the bf16 tolerance (afd serves in bf16): at most twice as far from the float32 reference
as transformers' own bf16 forward is (measured on this prompt: afd max |d| 0.75, mean 0.065;
transformers bf16 0.72 and 0.062), with a floor for near-zero differences."""

from __future__ import annotations

import signal

import httpx
import pytest
import torch

from afd.demo import write_tokenizer
from tests.helpers.checkpoints import hf_logits, hf_model, qwen3_moe
from tests.system.test_gateway import start_serve

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 65, 70, 68, 46]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = qwen3_moe(tmp_path_factory.mktemp("plp") / "ckpt")
    write_tokenizer(path)  # byte-level: ids 0..255 are bytes, inside the model's 384
    proc, url, _ = start_serve(path, "--transport", "inproc")
    yield path, url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def _reference(path, tokens):
    """Prompt token i's log-probability given tokens < i (i >= 1): float32 and bf16."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        logp = torch.log_softmax(hf_logits(hf_model(path, dtype), tokens), dim=-1)
        out.append(logp[:-1].gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1))
    return out


def _tolerance(ref32, ref16):
    return max(2 * (ref16 - ref32).abs().max().item(), 0.05)


def _complete(url, **body):
    r = httpx.post(f"{url}/completions", json={"model": "ckpt", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_the_reference(served, max_tokens):
    path, url = served
    ref32, ref16 = _reference(path, PROMPT)
    body = _complete(
        url, prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
    )
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = len(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1:n])
    assert (got - ref32).abs().max().item() <= _tolerance(ref32, ref16)
    assert choice["text"].startswith("Hello, world! AFD.")
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])  # logprobs=1: the best one
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == n
    assert body["usage"]["completion_tokens"] == max_tokens


def test_vllm_prompt_logprobs(served):
    path, url = served
    ref32, ref16 = _reference(path, PROMPT)
    body = _complete(url, prompt=PROMPT, max_tokens=2, prompt_logprobs=3, temperature=0)
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    got = torch.tensor([e[str(t)]["logprob"] for e, t in zip(entries[1:], PROMPT[1:], strict=True)])
    assert (got - ref32).abs().max().item() <= _tolerance(ref32, ref16)
    assert all(3 <= len(e) <= 4 for e in entries[1:])  # the token and the top 3 (may overlap)
    assert body["choices"][0]["logprobs"] is None  # not asked for the generated tokens


def test_chat_prompt_logprobs(served):
    """vLLM's chat prompt_logprobs: the rendered chat's tokens, scored as the reference
    scores them, at the top of the response."""
    path, url = served
    msgs = [{"role": "user", "content": "Hello, world! AFD."}]
    ids = httpx.post(url.removesuffix("/v1") + "/tokenize", json={"messages": msgs}).json()
    ref32, ref16 = _reference(path, ids["tokens"])
    body = {"model": "ckpt", "messages": msgs, "max_tokens": 1, "prompt_logprobs": 2}
    r = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    entries = r.json()["prompt_logprobs"]
    assert len(entries) == len(ids["tokens"]) and entries[0] is None
    pairs = zip(entries[1:], ids["tokens"][1:], strict=True)
    got = torch.tensor([e[str(t)]["logprob"] for e, t in pairs])
    assert (got - ref32).abs().max().item() <= _tolerance(ref32, ref16)
    streamed = httpx.post(f"{url}/chat/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and "not streamed" in streamed.text


def test_streamed_echo_carries_the_prompt_entries_first(served):
    _, url = served
    with httpx.stream(
        "POST",
        f"{url}/completions",
        json={
            "model": "ckpt",
            "prompt": PROMPT,
            "max_tokens": 2,
            "echo": True,
            "logprobs": 0,
            "temperature": 0,
            "stream": True,
        },  # fmt: skip
        timeout=60,
    ) as r:
        import json

        chunks = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    first = chunks[0]["choices"][0]
    assert first["text"] == "Hello, world! AFD."
    assert len(first["logprobs"]["token_logprobs"]) == len(PROMPT)
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(PROMPT) + 2
