"""What the API takes from the model besides its weights, as vLLM's flags set it: a chat template
given on the command line in place of the checkpoint's (`--chat-template`), and the sampling
defaults of the checkpoint's generation_config.json for the fields a request leaves out
(`--generation-config`: `auto` reads the model's, `vllm` none, a directory its own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from afd.errors import ConfigError, RequestError
from afd.sampling import SamplingParams

# generation_config.json's name -> the request field it is the default of (vLLM's set)
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself."""
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the chat template {value!r}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def sampling_defaults(source: str, model_dir: str) -> dict[str, Any]:
    """The request fields' defaults from a generation_config.json: {} for `vllm` or a model
    without one; refused at start-up where a value is one no request may carry."""
    if source == "vllm":
        return {}
    path = Path(model_dir if source == "auto" else source) / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise ConfigError(f"--generation-config {source!r}: no generation_config.json there")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    out = {
        field: data[key]
        for key, field in SAMPLING_KEYS.items()
        if isinstance(data.get(key), int | float) and not isinstance(data.get(key), bool)
    }
    try:
        SamplingParams(**out)
    except (RequestError, TypeError) as e:
        raise ConfigError(f"{path} sets a sampling value no request may carry: {e}") from None
    return out
