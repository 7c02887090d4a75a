"""`afd bench serve`'s prompt preparation against servers whose /tokenize differs (llama.cpp's
server takes {"content": ...}; a plain OpenAI endpoint has none), and how it counts tokens in
streamed chunks."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from afd_cli.bench.serve import Tokenizer, _chunk_tokens, _synthetic_text


def _server(form: str | None, calls: list[str]):
    """A /tokenize + /detokenize that understands one request form (None: no such route);
    one token per word, as the prompts here are made of words."""

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if form is None:
            return httpx.Response(404, json={"error": "not found"})
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            text = body.get(form)
            # llama.cpp answers a body it does not understand with no tokens, not an error
            return httpx.Response(
                200, json={"tokens": list(range(len(text.split()))) if text else []}
            )
        words = " ".join(f"w{i}" for i in body["tokens"])
        return httpx.Response(200, json={form: words})

    return httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://x")


def _prepare(form: str | None, n_tokens: int = 16) -> tuple[str, int, list[str], Tokenizer]:
    calls: list[str] = []

    async def go():
        async with _server(form, calls) as http:
            tok = Tokenizer(http, "http://x")
            text, n = await _synthetic_text(tok, random.Random(0), n_tokens)
            return text, n, tok

    text, n, tok = asyncio.run(go())
    return text, n, calls, tok


def test_a_vllm_style_tokenize_is_used_as_is():
    text, n, calls, tok = _prepare("prompt")
    assert tok.form == "prompt" and n == 16 and len(text.split()) == 16
    assert calls.count("/tokenize") == 2  # the text, then its cut to 16 tokens


def test_llama_servers_tokenize_is_found_not_looped_on():
    text, n, calls, tok = _prepare("content")
    assert tok.form == "content" and n == 16 and len(text.split()) == 16
    assert len(calls) < 8  # bounded: the old generator posted {"prompt"} forever


def test_without_tokenize_prompts_are_words_with_a_warning(capsys):
    text, n, calls, tok = _prepare(None)
    assert tok.absent and n == 0 and len(text.split()) == 16
    assert "approximated" in capsys.readouterr().err
    assert len(calls) == 2  # each form tried once, then no more


def test_a_chunk_per_token_even_with_empty_text():
    assert _chunk_tokens({"text": "", "finish_reason": None}, chat=False) == 1
    assert _chunk_tokens({"text": "a", "finish_reason": "length"}, chat=False) == 1
    assert _chunk_tokens({"text": "", "finish_reason": "stop"}, chat=False) == 0  # closing only
    assert _chunk_tokens({"delta": {"content": ""}, "finish_reason": None}, chat=True) == 1
    lp = {"tokens": ["a", "b"], "token_logprobs": [0, 0]}
    assert _chunk_tokens({"text": "ab", "logprobs": lp, "finish_reason": None}, chat=False) == 2
