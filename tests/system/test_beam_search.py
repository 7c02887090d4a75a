"""Beam search through the OpenAI API of a real `afd serve` (vLLM's `use_beam_search`, `n` the
beam width), against transformers' own beam search on the same checkpoint in float32: with EOS
out of play (`ignore_eos`; transformers with no EOS) both keep the `width` best sequences by
cumulative log-probability at every step, so the choices must be transformers' sequences, in
its order."""

from __future__ import annotations

import signal

import httpx
import pytest
import torch

from afd.demo import write_tokenizer
from tests.helpers.checkpoints import hf_logits, hf_model, qwen3_moe
from tests.system.test_gateway import start_serve

PROMPT = [72, 101, 108, 108, 111, 44, 32]
NEW = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = qwen3_moe(tmp_path_factory.mktemp("beams") / "ckpt")
    write_tokenizer(path)  # byte-level: ids 0..255 are bytes, inside the model's 384
    proc, url, _ = start_serve(
        path, "--transport", "inproc", "--dtype", "float32", "--a2f-dtype", "fp32"
    )
    yield path, url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def _reference(path, width: int, length_penalty: float) -> list[list[int]]:
    model = hf_model(path, torch.float32)
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([PROMPT]),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=NEW,
        do_sample=False,
        length_penalty=length_penalty,
        pad_token_id=0,
    )
    return out[:, len(PROMPT) :].tolist()


def _post(url, path, **body):
    r = httpx.post(f"{url}{path}", json={"model": "ckpt", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("width", [2, 4])
def test_beams_are_transformers_beams(served, width):
    path, url = served
    body = _post(
        url, "/completions", prompt=PROMPT, max_tokens=NEW, n=width, use_beam_search=True,
        ignore_eos=True, length_penalty=0.5, return_token_ids=True, logprobs=2,
        return_tokens_as_token_ids=True,
    )  # fmt: skip
    ref = _reference(path, width, 0.5)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == ref
    assert [c["text"] for c in choices] == [_text(url, r) for r in ref]
    assert choices[0]["prompt_token_ids"] == PROMPT
    # each token's logprob is the model's own: transformers' teacher-forced log-softmax
    seq = PROMPT + ref[0]
    logp = torch.log_softmax(hf_logits(hf_model(path, torch.float32), seq), dim=-1)
    want = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(ref[0])]
    lp = choices[0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 2 for top in lp["top_logprobs"])
    assert lp["tokens"] == [f"token_id:{t}" for t in ref[0]]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == width * NEW
    assert body["usage"]["prompt_tokens"] == len(PROMPT)


def test_a_chat_stream_gets_the_best_beam(served):
    _, url = served
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": NEW}
    whole = _post(url, "/chat/completions", **chat, n=2, use_beam_search=True, ignore_eos=True)
    with httpx.stream(
        "POST", f"{url}/chat/completions", timeout=120,
        json={**chat, "n": 2, "use_beam_search": True, "ignore_eos": True, "stream": True},
    ) as r:  # fmt: skip
        assert r.status_code == 200
        text = {0: "", 1: ""}
        import json

        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text[c["index"]] += c["delta"].get("content") or ""
    assert [text[0], text[1]] == [c["message"]["content"] for c in whole["choices"]]


def test_what_a_beam_search_cannot_do_is_a_400(served):
    _, url = served
    for extra, param in (({"echo": True}, "echo"), ({"stop": ["x"]}, "stop")):
        r = httpx.post(
            f"{url}/completions",
            json={"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True, **extra},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _text(url, ids):
    r = httpx.post(f"{url.removesuffix('/v1')}/detokenize", json={"tokens": ids}, timeout=30)
    return r.json()["prompt"]
