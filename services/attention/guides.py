"""Structured outputs: a request's tokens held to a JSON schema, any JSON object, a regular
expression, one of a list of strings, an EBNF grammar, or a structural tag (free text in which
tags hold what they say; afd.sampling.GUIDE_KINDS), with xgrammar (the engine vLLM and SGLang
use for this).

A guided request gets a grammar matcher when it is added (its guide compiled against the
checkpoint's tokenizer, compiled guides cached); before each of its tokens is chosen, the
tokens the grammar cannot take next are masked out of its logits (so penalties, temperature and
logprobs all see the masked logits, as in vLLM); after, the matcher takes the token. When the
grammar is complete the request ends: on its EOS or stop token where it has one (the matcher
allows only those then), else at once.

A guide may wait (`SamplingParams.guide_after`): the output is free until it holds the given
tokens (a thinking model's end of reasoning), and the grammar holds from the next token on, as
vLLM starts structured outputs after the reasoning."""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from afd.config import ModelConfig
from afd.errors import RequestError
from afd.kernels import bitmask

if TYPE_CHECKING:
    from services.attention.request import Request

log = logging.getLogger("afd.attention")

_CACHED = 64  # compiled guides kept (a service sees the same few schemas again and again)
# Nesting a JSON schema may have: compiling one grows steeply with it (0.13 s at 100 levels,
# 11 s at 400 on this project's 2-core box, on the engine thread), and a few levels serve
# every real schema.
MAX_SCHEMA_DEPTH = 64


class Guides:
    def __init__(self, model: ModelConfig):
        self._model = model
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on first use
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._matchers: dict[str, Any] = {}  # request id -> xgrammar.GrammarMatcher
        # request id -> (the marker its guide waits for, its output's last tokens)
        self._waiting: dict[str, tuple[tuple[int, ...], list[int]]] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32

    def start(self, req: Request) -> None:
        """Give a guided request its matcher; RequestError for a guide that does not compile."""
        sp = req.sampling
        if not sp.guide_kind:
            return
        if req.request_id in self._matchers:  # (else it would take the running one's matcher)
            raise RequestError(f"request id {req.request_id!r} is already in use")
        xgr = _xgrammar()
        compiled = self._compile(sp.guide_kind, sp.guide)
        ends = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(req.eos_token_ids))
        self._matchers[req.request_id] = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=ends or None,
            terminate_without_stop_token=not ends,
        )
        if sp.guide_after:
            self._waiting[req.request_id] = (sp.guide_after, [])

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def mask_(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """-inf for every token the rows' grammars cannot take next (logits [B, V] float32,
        row i is request_ids[i]'s)."""
        rows = [
            (i, self._matchers[r])
            for i, r in enumerate(request_ids)
            if r in self._matchers and r not in self._waiting
        ]
        if not rows:
            return
        xgr = _xgrammar()
        B, V = logits.shape
        if self._bitmask is None or self._bitmask.shape[0] < B:
            self._bitmask = xgr.allocate_token_bitmask(max(B, 8), V)
        mask = self._bitmask[:B]
        for i, matcher in rows:
            matcher.fill_next_token_bitmask(mask, i)
        indices = [i for i, _ in rows]
        if bitmask.usable(logits, mask):
            bitmask.apply_(logits, mask, indices)
        else:  # another device, or no native library
            xgr.apply_token_bitmask_inplace(logits, mask, indices=indices)

    def mask_drafted_(self, rows: torch.Tensor, request_id: str, drafts: tuple[int, ...]) -> None:
        """A speculating request's rows [1 + k, V] (its last token's and its k drafts'): row i
        masked for the grammar's state after the first i drafts, as step-by-step decoding
        would have it. The matcher walks the drafts and steps back; where the grammar refuses
        a draft, or ends with it, the rows after it (never kept) repeat its row's mask."""
        matcher = self._matchers.get(request_id)
        if matcher is None or request_id in self._waiting:
            return
        xgr = _xgrammar()
        n, V = rows.shape
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 8), V)
        mask = self._bitmask[:n]
        walked = 0
        for i in range(n):
            matcher.fill_next_token_bitmask(mask, i)
            if i == n - 1:
                break
            taken = matcher.accept_token(drafts[i])
            walked += taken
            if not taken or matcher.is_terminated():
                mask[i + 1 :] = mask[i]
                break
        if walked:
            matcher.rollback(walked)
        if bitmask.usable(rows, mask):
            bitmask.apply_(rows, mask, list(range(n)))
        else:
            xgr.apply_token_bitmask_inplace(rows, mask, indices=list(range(n)))

    def accept(self, request_id: str, token: int) -> bool:
        """The matcher takes the request's token; True when the grammar has ended it."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        waiting = self._waiting.get(request_id)
        if waiting is not None:
            marker, recent = waiting
            recent.append(token)
            del recent[: -len(marker)]
            if tuple(recent) == marker:  # the grammar holds from the next token
                del self._waiting[request_id]
            return False
        if not matcher.accept_token(token):  # the mask allowed only what it accepts
            log.warning("request %s: its grammar refused token %d; ending it", request_id, token)
            return True
        return matcher.is_terminated()

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def _compile(self, kind: str, guide: str) -> Any:
        key = (kind, guide)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        compiler = self._compiler or self._make_compiler()
        if kind in ("json", "structural_tag"):  # (a structural tag holds JSON schemas)
            _check_depth(guide)
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(guide)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}')  # OpenAI: an object
            elif kind == "regex":
                compiled = compiler.compile_regex(guide)
            elif kind == "choice":
                compiled = compiler.compile_grammar(_choice_grammar(guide))
            elif kind == "structural_tag":  # xgrammar's form (the gateway writes it so)
                compiled = compiler.compile_structural_tag(guide)
            else:  # grammar
                compiled = compiler.compile_grammar(guide)
        except Exception as e:  # whatever xgrammar raises, a bad guide is this request's error
            raise RequestError(f"the {kind} guide does not compile: {_why(e)}") from None
        self._compiled[key] = compiled
        if len(self._compiled) > _CACHED:
            self._compiled.popitem(last=False)
        return compiled

    def _make_compiler(self) -> Any:
        xgr = _xgrammar()
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self._model.path)
        except (OSError, ValueError) as e:
            raise RequestError(
                f"structured outputs need the checkpoint's tokenizer, and {self._model.path!r} "
                f"has none that loads: {e}"
            ) from None
        info = xgr.TokenizerInfo.from_huggingface(
            tok,
            vocab_size=self._model.vocab_size,
            stop_token_ids=list(self._model.eos_token_ids) or None,
        )
        self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def _check_depth(schema: str) -> None:
    depth = deepest = 0
    in_string = escaped = False
    for ch in schema:  # brackets outside strings: no parse, so no recursion to exhaust
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_SCHEMA_DEPTH:
        raise RequestError(
            f"the json guide nests {deepest} levels deep; at most {MAX_SCHEMA_DEPTH} are served"
        )


def _why(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:12: ")."""
    lines = str(e).strip().splitlines()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(e).__name__


def _choice_grammar(choices_json: str) -> str:
    """An EBNF grammar whose only sentences are the given strings (a JSON list of them)."""
    choices = json.loads(choices_json)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise RequestError(
            "structured outputs need xgrammar, which this server lacks: "
            "pip install 'afd[structured]'"
        ) from None
    return xgrammar
