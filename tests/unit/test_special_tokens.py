"""A text prompt gets the tokenizer's own special tokens as transformers' `tokenizer(text)` gives
them (the BOS that Llama, Mistral and DeepSeek tokenizers put first), as vLLM's completions do
by default; a chat's template writes them itself, so a chat gets none unless it asks; /tokenize
follows the same defaults and spells tokens as the vocabulary does when asked."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

from afd.demo import BOS_TOKEN, BOS_TOKEN_ID, write_tokenizer
from afd.tokenizer import ModelTokenizer
from tests.unit.test_gateway_app import FakeClient, make, post, run

TEXTS = ["hi", "Hello, world!", " leading blank", "<|begin|>already there", "ünï"]


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory):
    """The demo tokenizer with a post-processor that puts its BOS first (as Llama's does)."""
    d = tmp_path_factory.mktemp("bos")
    write_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_and_spelling_match_transformers(bos_dir, text):
    ours, hf = ModelTokenizer(bos_dir), AutoTokenizer.from_pretrained(bos_dir)
    with_special = ours.encode(text, add_special_tokens=True)
    assert with_special == hf(text).input_ids and with_special[0] == BOS_TOKEN_ID
    assert ours.encode(text) == hf(text, add_special_tokens=False).input_ids
    assert ours.token_strs(with_special) == hf.convert_ids_to_tokens(with_special)


def _calls(tokenizer, path, body):
    fake = FakeClient(text="ab", finish="stop")

    async def go():
        async with make(tokenizer, [fake]) as c:
            return await post(c, path, {"max_tokens": 2, **body})

    r = run(go())
    assert r.status_code == 200, r.text
    return [prompt for _, prompt, _ in fake.calls]


def test_completions_add_them_and_chats_do_not_unless_asked(bos_dir):
    tok = ModelTokenizer(bos_dir)
    (ids,) = _calls(tok, "/v1/completions", {"prompt": "hi"})
    assert ids == [BOS_TOKEN_ID, *tok.encode("hi")]
    (ids,) = _calls(tok, "/v1/completions", {"prompt": "hi", "add_special_tokens": False})
    assert ids == tok.encode("hi")
    (ids,) = _calls(tok, "/v1/completions", {"prompt": [5, 6]})  # token ids: as given
    assert ids == [5, 6]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    rendered = tok.encode(tok.apply_chat_template(chat["messages"]))
    assert rendered[0] == BOS_TOKEN_ID  # the demo template writes it
    (ids,) = _calls(tok, "/v1/chat/completions", chat)
    assert ids == rendered
    (ids,) = _calls(tok, "/v1/chat/completions", {**chat, "add_special_tokens": True})
    assert ids == [BOS_TOKEN_ID, *rendered]


def test_tokenize_defaults_and_token_strs(bos_dir):
    tok, hf = ModelTokenizer(bos_dir), AutoTokenizer.from_pretrained(bos_dir)

    async def go(body):
        async with make(tok, [FakeClient()]) as c:
            r = await post(c, "/tokenize", body)
            assert r.status_code == 200, r.text
            return r.json()

    out = run(go({"prompt": "hi there", "return_token_strs": True}))
    assert out["tokens"] == hf("hi there").input_ids
    assert out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])
    out = run(go({"prompt": "hi there", "add_special_tokens": False}))
    assert out["tokens"] == hf("hi there", add_special_tokens=False).input_ids
    assert "token_strs" not in out
    msgs = [{"role": "user", "content": "hi"}]
    out = run(go({"messages": msgs}))
    assert out["tokens"] == tok.encode(tok.apply_chat_template(msgs))
