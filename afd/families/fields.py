"""Typed reads of a raw config.json dict, shared by every family's parser.

Families spell the same quantity differently (`num_experts`, `num_local_experts`,
`moe_num_experts`); a parser names every spelling it accepts, and a missing field surfaces as a
KeyError naming the first, which `ModelConfig.from_dict` reports as a `ConfigError`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from afd.config import RopeScaling

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

    def _rope(self) -> dict[str, Any]:
        # transformers >= 5 writes rope_parameters; older configs rope_scaling + rope_theta
        for name in ("rope_parameters", "rope_scaling"):
            params = self.raw.get(name)
            if isinstance(params, dict):
                return params
        return {}

    def rope_theta(self, default: float) -> float:
        params = self._rope()
        if params.get("rope_theta") is not None:
            return float(params["rope_theta"])
        return self.float("rope_theta", default)

    def rope_scaling(self) -> RopeScaling | None:
        """YaRN parameters, None for plain RoPE; any other scaling is refused, not ignored."""
        p = self._rope()
        kind = p.get("rope_type", p.get("type"))
        if kind in (None, "default"):
            return None
        if kind != "yarn":
            raise ValueError(f"rope scaling {kind!r} is not supported (afd applies yarn)")
        factor = p.get("factor")
        original = int(p["original_max_position_embeddings"])
        if factor is None:  # as transformers derives it
            factor = self.int("max_position_embeddings") / original
        opt = {k: float(p[k]) for k in ("beta_fast", "beta_slow") if p.get(k)}
        return RopeScaling(
            factor=float(factor),
            original_max_position=original,
            mscale=float(p.get("mscale") or 0.0),
            mscale_all_dim=float(p.get("mscale_all_dim") or 0.0),
            attention_factor=(
                None if p.get("attention_factor") is None else float(p["attention_factor"])
            ),
            truncate=bool(p.get("truncate", True)),
            **opt,
        )

    def weight_block(self) -> tuple[int, int] | None:
        """A block-FP8 checkpoint's block shape; None for unquantized weights. Any other
        quantization is refused here, not discovered as a shape error later."""
        q = self.raw.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method == "mxfp4":
            return None  # experts only: mxfp4() below
        if method != "fp8":
            raise ValueError(
                f"quantization {method!r} is not supported (afd loads block fp8 and mxfp4)"
            )
        block = q.get("weight_block_size") or [128, 128]
        if len(block) != 2 or min(int(b) for b in block) < 1:
            raise ValueError(f"weight_block_size {block!r} is not two positive sizes")
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 format {q.get('fmt')!r} is not supported (afd reads e4m3)")
        return int(block[0]), int(block[1])

    def mxfp4(self) -> bool:
        """Whether the routed experts are stored as MXFP4 (gpt-oss's layout)."""
        q = self.raw.get("quantization_config")
        return isinstance(q, dict) and q.get("quant_method") == "mxfp4"

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
            rope_scaling=self.rope_scaling(),
            weight_block=self.weight_block(),
            mxfp4_experts=self.mxfp4(),
            tie_word_embeddings=bool(self.raw.get("tie_word_embeddings", False)),
            eos_token_ids=self.eos(),
            bos_token_id=self.raw.get("bos_token_id"),
            torch_dtype=str(self.raw.get("dtype") or self.raw.get("torch_dtype") or "bfloat16"),
            weight_prefix=prefix,
            path=path,
        )
