"""Tokenizer and chat template from a model directory (no transformers needed at run time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from afd.errors import ConfigError


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
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ConfigError("this model has no chat template; use a completion prompt")
        return self._env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


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
