"""Tokenizer and chat template from a model directory (no transformers needed at run time).

The chat template is rendered in jinja's immutable sandbox (a template is data from the model
directory, not trusted code), with a budget: a time limit checked on the template's own lines
(every loop iteration of compiled template code is a line, so no loop escapes it), a cap on the
text it produces, and no string or list repetition past that cap. A template that loops
forever or blows up is a RequestError, never a hung gateway.

Templates see what `transformers`' apply_chat_template gives them, so a model's prompt is the
same text here as there: `messages`, `tools`, `documents`, `add_generation_prompt`, the
special tokens, any extra variables (vLLM's `chat_template_kwargs`), the globals
`raise_exception` and `strftime_now`, a `tojson` that does not escape HTML, and `break` /
`continue` in loops.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from afd.errors import ConfigError, RequestError

MAX_TEMPLATE_CHARS = 8 << 20  # the rendered prompt, at most
_CHECK_EVERY = 256  # template lines between two looks at the clock


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, refusing `*` and `**` whose result would be huge."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str | list | tuple) and isinstance(n, int):
                if len(seq) * n > MAX_TEMPLATE_CHARS:
                    raise SecurityError("the chat template builds a value that is too large")
        elif operator == "**" and isinstance(right, int) and abs(right) > 4096:
            raise SecurityError("the chat template computes too large a power")
        return super().call_binop(context, operator, left, right)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; transformers' (the templates'
    # reference) does not, and a tool description with a "<" must render the same here
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# what the template itself receives; a request's extra variables may not replace them
TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)


class ModelTokenizer:
    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(
                f"{d} has no tokenizer.json; pass token ids instead of text, or add the tokenizer"
            )
        self.tok = Tokenizer.from_file(str(tok_file))
        cfg = _read_json(d / "tokenizer_config.json")
        template = cfg.get("chat_template")
        jinja = d / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        # Sandboxed: a chat template is data from the model directory, not trusted code.
        self._env = _BudgetedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = _strftime_now
        self._template = None  # compiled on first use

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` instead of the model's own (vLLM's --chat-template)."""
        self.chat_template, self._template = template, None

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.tok.token_to_id(self.eos_token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: what the tokenizer's post-processor puts around a text (a BOS,
        for some), as transformers' tokenizer(text) does; special tokens written in the text
        are read as such either way."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def token_strs(self, ids: list[int]) -> list[str | None]:
        """Each id as the vocabulary spells it (byte-level tokens in their printable form)."""
        return [self.tok.id_to_token(i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        time_limit_s: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> str:
        """The rendered prompt; with `time_limit_s`, a render that takes longer raises
        RequestError (so does one longer than MAX_TEMPLATE_CHARS, always). `tools`: OpenAI
        tool definitions ({"type": "function", "function": {...}}); `extra`: more variables;
        `continue_final`: the prompt ends inside the last message, for the model to go on
        with it (transformers' and vLLM's continue_final_message)."""
        if continue_final and add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        if not self.chat_template:
            raise ConfigError("this model has no chat template; use a completion prompt")
        clash = sorted(TEMPLATE_NAMES & set(extra or ()))
        if clash:
            raise RequestError(f"the chat template's own variables cannot be replaced: {clash}")
        if self._template is None:
            self._template = self._env.from_string(self.chat_template)
        chunks = self._template.generate(
            **(extra or {}),
            messages=_marked(messages) if continue_final else messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        if time_limit_s is None:
            text = _join(chunks)
        else:
            text = _with_time_limit(lambda: _join(chunks), time_limit_s)
        return _open_final(text) if continue_final else text


# Marks where the last message's text ends in a rendered prompt (continue_final_message); the
# blank after it tells whether the template kept the text's trailing blanks.
_END_OF_LAST = "AFD_END_OF_THE_LAST_MESSAGE "


def _marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of `messages` whose last message's text (its last text part) ends in the
    marker."""
    last = dict(messages[-1])
    text = last.get("content")
    if isinstance(text, list):  # content parts: the last one with text
        parts = [dict(p) if isinstance(p, dict) else p for p in text]
        at = next((i for i in reversed(range(len(parts))) if "text" in parts[i]), None)
        if at is not None:
            parts[at]["text"] = str(parts[at]["text"]) + _END_OF_LAST
            last["content"] = parts
            return [*messages[:-1], last]
    elif isinstance(text, str) and text.strip():
        last["content"] = text + _END_OF_LAST
        return [*messages[:-1], last]
    raise RequestError("continue_final_message: the last message has no text to continue")


def _open_final(prompt: str) -> str:
    """The rendered prompt cut where the last message's text ends, so the model continues
    it; where the template trimmed that text's trailing blanks, trimmed there too."""
    at = prompt.rfind(_END_OF_LAST.strip())
    if at < 0:
        raise RequestError(
            "continue_final_message: the chat template does not show the last message's text"
        )
    kept = prompt.startswith(_END_OF_LAST, at)
    return prompt[:at] if kept else prompt[:at].rstrip()


class _TimeUp(Exception):
    pass


def _join(chunks) -> str:
    out, n = [], 0
    for chunk in chunks:
        n += len(chunk)
        if n > MAX_TEMPLATE_CHARS:
            raise RequestError(
                f"the chat template's output exceeds {MAX_TEMPLATE_CHARS} characters"
            )
        out.append(chunk)
    return "".join(out)


def _with_time_limit(render, limit_s: float) -> str:
    """Run `render` with a trace on this thread that counts the lines of compiled template
    code ('<template>') and raises once `limit_s` has passed."""
    deadline = time.monotonic() + limit_s
    lines = 0

    def on_line(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise _TimeUp
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return render()
    except _TimeUp:
        raise RequestError(
            f"the chat template did not finish rendering within {limit_s:g} s"
        ) from None
    finally:
        sys.settrace(previous)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None
