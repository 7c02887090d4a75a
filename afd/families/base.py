"""What a model family is to afd, and the registry of the families afd serves.

A family (a Hugging Face `model_type`) differs from the others in three places only: the
field names of its config.json, the names of its checkpoint tensors, and which kinds of
attention, router and FFN its layers use. A `Family` states those three in one value, so that
adding a family is one new file in this package (plus its tests) and nothing in afd or the
services is keyed by `model_type`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from afd.errors import ConfigError
from afd.families.names import WeightNames

if TYPE_CHECKING:
    from afd.config import ModelConfig
    from afd.families.fields import Fields


@dataclass(frozen=True)
class Family:
    """One model family: how to read its config.json and its weights, and what it is made of.

    model_type: the config.json `model_type` this entry serves (a vision-language wrapper's
        `text_config.model_type` counts too).
    parse: config.json fields -> afd's one normalised `ModelConfig`, called as
        parse(fields, path, weight_prefix). Raise KeyError for a missing required field and
        ValueError/TypeError for a malformed one: `ModelConfig.from_dict` turns each into a
        `ConfigError` naming the family and the field. `fields.common(path, weight_prefix)`
        fills the fields every family shares, this entry's kinds below included.
    weights: how the family's HF tensor names map to afd's canonical names
        (see afd/checkpoint.py for the canonical names, afd/families/names.py for the map).
    attention: the attention kind, a key of the attention service's own registry
        (services/attention/kinds: "gqa", "mfa").
    router: the router kind, a key of services/attention/moe_router.py's ROUTERS
        ("softmax_topk").
    ffn: the FFN kind of its experts, shared expert and dense MLPs ("swiglu").
    """

    model_type: str
    parse: Callable[[Fields, str, str], ModelConfig]
    weights: WeightNames
    attention: str
    router: str
    ffn: str


# model_type -> Family; filled by each family's module on import (afd/families/__init__.py).
FAMILIES: dict[str, Family] = {}


def register(fam: Family) -> Family:
    """Add a family to the registry; a second entry for one model_type is a programming error."""
    if fam.model_type in FAMILIES:
        raise ValueError(f"model_type {fam.model_type!r} is registered twice")
    FAMILIES[fam.model_type] = fam
    return fam


def family(model_type: object) -> Family:
    """The registered family of `model_type`, or a ConfigError naming the ones afd serves."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; afd serves: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
