"""The model families afd serves: one module each, one `Family` registry entry each.

A family's module registers its `Family` (afd/families/base.py documents the contract) when it
is imported; importing this package imports every family module, so `FAMILIES` is complete as
soon as anything looks a family up. Adding a family: a new module here, named in the import below.
"""

from afd.families import (  # noqa: F401 (each registers itself)
    deepseek_v3,
    deepseek_v32,
    gpt_oss,
    mixtral,
    qwen3_moe,
    step3_text,
)
from afd.families.base import FAMILIES, Family, family, register
from afd.families.fields import Fields
from afd.families.names import WeightNames

__all__ = ["FAMILIES", "Family", "Fields", "WeightNames", "family", "register"]
