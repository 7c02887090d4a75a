"""Incremental detokenization and stop strings on the demo's byte-level tokenizer, where every
multi-byte character is split over several tokens."""

import random

import pytest

from afd.demo import EOS_TOKEN_ID, write_tokenizer
from afd.tokenizer import ModelTokenizer
from services.gateway.detok import IncrementalDetokenizer, StopMatcher, TokenBytes


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return ModelTokenizer(d)


def stream(tok, ids, prompt=()):
    d = IncrementalDetokenizer(tok, list(prompt))
    pieces = [d.add([i]) for i in ids]
    return pieces, d.flush()


def test_emoji_split_over_byte_tokens_never_emits_replacement(tok):
    text = "hi 😀 café 👩‍👩‍👧 日本語!"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte: every emoji is split
    pieces, rest = stream(tok, ids, tok.encode("prompt: "))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + rest == text
    assert pieces[3:6] == ["", "", ""] and pieces[6] == "😀"  # held until the 4th byte


def test_random_texts_and_chunkings_round_trip(tok):
    rng = random.Random(0)
    alphabet = "ab Z€😀ñ日\n"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        ids = tok.encode(text)
        d = IncrementalDetokenizer(tok, [])
        out, i = [], 0
        while i < len(ids):
            step = rng.randint(1, 4)
            out.append(d.add(ids[i : i + step]))
            i += step
        out.append(d.flush())
        assert "\ufffd" not in "".join(out)
        assert "".join(out) == text


def test_truncated_character_at_the_end_is_flushed_like_a_one_shot_decode(tok):
    ids = tok.encode("ok😀")[:-2]  # max_tokens cut the emoji in half
    pieces, rest = stream(tok, ids)
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + rest == tok.decode(ids)


def test_special_tokens_are_skipped(tok):
    pieces, rest = stream(tok, [*tok.encode("ab"), EOS_TOKEN_ID])
    assert "".join(pieces) + rest == "ab"


def test_prompt_ending_mid_character_does_not_shift_the_output(tok):
    prompt = tok.encode("x😀")[:-1]
    pieces, rest = stream(tok, tok.encode("yz"), prompt)
    assert "".join(pieces) + rest == "yz"


def feed_all(stops, pieces, include=False):
    m = StopMatcher(stops, include)
    out = []
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def test_stop_string_split_over_pieces_is_matched_and_not_leaked():
    out, stopped = feed_all(["STOP"], ["hello S", "T", "O", "P and more"])
    assert stopped
    assert "".join(out) == "hello "
    assert all("S" not in o for o in out)  # the held-back "S" never went out


def test_partial_match_that_fails_is_released():
    out, stopped = feed_all(["abd"], ["xab", "c", "ab"])
    assert not stopped
    assert out == ["x", "abc", "", "ab"]  # "ab" held twice, then flushed at the end


def test_earliest_stop_wins_and_one_piece_can_hold_it():
    out, stopped = feed_all(["world", "lo"], ["hello world"])
    assert stopped and out == ["hel"]


def test_included_stop_strings_end_the_text_with_the_earliest_longest_match():
    """vLLM's include_stop_str_in_output: the text up to and with the stop string."""
    out, stopped = feed_all(["STOP"], ["hello S", "T", "O", "P and more"], include=True)
    assert stopped and "".join(out) == "hello STOP"
    out, stopped = feed_all(["lo", "world", "lo w"], ["hello world"], include=True)
    assert stopped and out == ["hello w"]


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)


def test_stop_across_emoji_bytes(tok):
    ids = tok.encode("a😀b😀c")
    d, m = IncrementalDetokenizer(tok, []), StopMatcher(["😀c"])
    out = []
    for i in ids:
        text, stopped = m.feed(d.add([i]))
        out.append(text)
        if stopped:
            break
    assert stopped and "".join(out) == "a😀b"


def test_token_bytes_are_exact_for_partial_characters(tok):
    tb = TokenBytes(tok)
    ids = tok.encode("é")
    assert [tb(i) for i in ids] == [b"\xc3", b"\xa9"]
    assert tb(EOS_TOKEN_ID) == b"<|end|>"
    assert tb.text(tok.encode("a")[0]) == "a"
