"""Token ids -> text, one step at a time, and stop strings matched on that text.

`IncrementalDetokenizer` never emits text that ends inside a UTF-8 sequence: a token that
carries only part of a character (byte-level tokenizers split emoji over several tokens)
produces no text until the rest arrives. `StopMatcher` holds back any tail of the text that
could be the start of a stop string, so a stop string split over tokens is still matched and
never reaches the client.
"""

from __future__ import annotations

import json
from typing import Protocol

REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 4  # prompt tokens decoded along with the first outputs (see __init__)


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for a growing list of token ids.

    Each step decodes a short window: the ids from the previous emission point on (`prefix`)
    against the same window without the ids not yet emitted (`read`). Decoding a window rather
    than single tokens keeps tokenizers right that render a token differently depending on its
    neighbours (SentencePiece's leading space).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: list[int] | tuple[int, ...] = (),
        skip_special_tokens: bool = True,
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # A few prompt tokens as context, so the first output token decodes as it would
        # mid-text; they are never emitted themselves.
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        if self._decode(0, len(self._ids)).endswith(REPLACEMENT):
            self._ids = []  # a prompt ending mid-character would shift every offset below
        self._prefix = 0
        self._read = len(self._ids)
        self._context = len(self._ids)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is complete (possibly "")."""
        self._ids.extend(token_ids)
        before = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix, len(self._ids))
        if len(full) <= len(before) or full.endswith(REPLACEMENT):
            return ""  # nothing new yet, or the last character is still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(before) :]

    def flush(self) -> str:
        """At the end of the request: whatever is left, even an incomplete character (as U+FFFD,
        so the streamed text equals a one-shot decode of the same ids)."""
        before = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return full[len(before) :] if len(full) > len(before) else ""

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._context

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)


class StopMatcher:
    """Finds the first of `stops` in a stream of text pieces without ever emitting any of it
    (`include`: the stop string itself is emitted, vLLM's include_stop_str_in_output)."""

    def __init__(self, stops: tuple[str, ...] | list[str] = (), include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self.matched: str | None = None  # the stop string found
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was found). After a match, the
        text after the stop string (or from it on) is dropped."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [(i, -len(s), s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self._held = ""
            at, _, self.matched = min(hits)  # the earliest; of those starting there, the longest
            return buf[: at + len(self.matched) if self.include else at], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, when the request ends without a match."""
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: b for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in table.items()}


class TokenBytes:
    """The exact bytes of one token, for logprobs (`bytes`) where a token may be part of a
    character. Knows byte-level (GPT-2) vocabularies and SentencePiece byte fallback; any
    other token is its decoded text."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer  # afd.tokenizer.ModelTokenizer
        raw = tokenizer.tok
        decoder = json.dumps(json.loads(raw.to_str()).get("decoder"))
        self._byte_level = '"ByteLevel"' in decoder
        self._chars = _byte_level_chars() if self._byte_level else {}
        self._special = {i for i, t in raw.get_added_tokens_decoder().items() if t.special}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._lookup(token_id)
        return b

    def text(self, token_id: int) -> str:
        return self(token_id).decode("utf-8", errors="replace")

    def _lookup(self, token_id: int) -> bytes:
        piece = self._tok.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode()
        if self._byte_level and all(c in self._chars for c in piece):
            return bytes(self._chars[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        return self._tok.decode([token_id], skip_special_tokens=False).encode()
