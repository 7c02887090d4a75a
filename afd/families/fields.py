"""Typed reads of a raw config.json dict, shared by every family's parser.

Families spell the same quantity differently (`num_experts`, `num_local_experts`,
`moe_num_experts`); a parser names every spelling it accepts, and a missing field surfaces as a
KeyError naming the first, which `ModelConfig.from_dict` reports as a `ConfigError`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from afd.families.base import Family


class Fields:
    """Typed access to a raw config dict, with a clear error naming a missing field."""

    def __init__(self, raw: dict[str, Any], family: Family):
        self.raw = raw
        self.family = family
        self.model_type = family.model_type

    def int(self, *names: str, default: Any = dataclasses.MISSING) -> int:
        for n in names:
            if self.raw.get(n) is not None:
                return int(self.raw[n])
        if default is dataclasses.MISSING:
            raise KeyError(names[0])
        return default

    def float(self, name: str, default: float) -> float:
        v = self.raw.get(name)
        return float(default if v is None else v)

    def rope_theta(self, default: float) -> float:
        # transformers >= 5 nests it under rope_parameters; older configs keep it top-level
        params = self.raw.get("rope_parameters") or {}
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            return float(params["rope_theta"])
        scaling = self.raw.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (
            None,
            "default",
        ):
            raise ValueError(f"rope_scaling {scaling!r} is not supported yet")
        return self.float("rope_theta", default)

    def eos(self) -> tuple[int, ...]:
        v = self.raw.get("eos_token_id")
        if v is None:
            return ()
        return tuple(int(x) for x in (v if isinstance(v, list) else [v]))

    def common(self, path: str, prefix: str) -> dict[str, Any]:
        """The `ModelConfig` fields every family fills the same way, its kinds included."""
        hidden = self.int("hidden_size")
        heads = self.int("num_attention_heads")
        return dict(
            model_type=self.model_type,
            attention=self.family.attention,
            router=self.family.router,
            ffn=self.family.ffn,
            vocab_size=self.int("vocab_size"),
            hidden_size=hidden,
            num_layers=self.int("num_hidden_layers"),
            num_heads=heads,
            head_dim=self.int("head_dim", default=hidden // heads),
            rms_norm_eps=self.float("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(self.raw.get("tie_word_embeddings", False)),
            eos_token_ids=self.eos(),
            bos_token_id=self.raw.get("bos_token_id"),
            torch_dtype=str(self.raw.get("dtype") or self.raw.get("torch_dtype") or "bfloat16"),
            weight_prefix=prefix,
            path=path,
        )
